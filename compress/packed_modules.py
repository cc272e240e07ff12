"""The module that serves a packed format on a device: int4 linears (tinygemm on CUDA sm80+,
else `compress.packed.PackedLinear4`), int8 per channel or in groups, and embeddings, int8 per
row or int4 in groups, whose lookups dequantize only the rows they read through the linear a
tied `lm_head` shares (the codes in memory once)."""

from __future__ import annotations

import torch
from torch import nn

from compress.packed import (
    PackedFormat,
    PackedLinear4,
    PackedLinear8,
    PackedLinear8Grouped,
    Quantized,
)
from compress.packed_cuda import TinygemmLinear4, tinygemm_runs


class PackedEmbedding8(nn.Module):
    """int8 rows: a lookup dequantizes only the rows it reads. `embed_scale` (Gemma multiplies
    its embeddings by sqrt(hidden)) is kept from the module it replaces."""

    embed_scale: torch.Tensor | None
    row_scales: torch.Tensor
    row_offsets: torch.Tensor | None

    def __init__(self, qw: Quantized, dtype: torch.dtype, embed_scale: torch.Tensor | None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qw.q.shape
        self.linear = PackedLinear8(qw, None, dtype)
        self.embed_scale = embed_scale
        self.dtype = dtype
        self.register_buffer("row_scales", qw.scales[:, 0].clone(), persistent=False)
        offset = (128 - qw.zeros[:, 0]) * qw.scales[:, 0]
        self.register_buffer("row_offsets", offset if offset.any() else None, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows dequantized in float32 from their float32 scales, then in the model's dtype."""
        out = self.linear.q_signed[ids].float() * self.row_scales[ids][..., None]
        if self.row_offsets is not None:
            out = out + self.row_offsets[ids][..., None]
        out = out.to(self.dtype)
        return out if self.embed_scale is None else out * self.embed_scale.to(out.dtype)


class PackedEmbedding4(nn.Module):
    """int4 rows in groups: a lookup dequantizes only the rows it reads, from the codes (and, on
    the CPU, the bfloat16 scales) a tied head's kernel reads. `embed_scale` as in
    `PackedEmbedding8`."""

    embed_scale: torch.Tensor | None

    def __init__(self, qw: Quantized, dtype: torch.dtype, embed_scale: torch.Tensor | None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qw.q.shape
        self.linear = int4_linear(qw, None, dtype)
        self.embed_scale = embed_scale
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.linear.rows(ids).to(self.dtype)
        return out if self.embed_scale is None else out * self.embed_scale.to(out.dtype)


def packed_embedding(
    fmt: PackedFormat, qw: Quantized, dtype: torch.dtype, embed_scale: torch.Tensor | None
) -> PackedEmbedding4 | PackedEmbedding8:
    if fmt.bits == 8 and fmt.group_size is not None:
        raise ValueError(f"an embedding is int8 per row or int4 in groups, not {fmt.name}")
    return (PackedEmbedding4 if fmt.bits == 4 else PackedEmbedding8)(qw, dtype, embed_scale)


def int4_linear(
    qw: Quantized, bias: torch.Tensor | None, dtype: torch.dtype
) -> PackedLinear4 | TinygemmLinear4:
    """The int4 linear for the codes' device: tinygemm where it runs (CUDA, sm80+), else
    `PackedLinear4` (the CPU kernel, or dequantized per call)."""
    if tinygemm_runs(qw.q.device):
        return TinygemmLinear4(qw.q, qw.scales, qw.zeros, bias, dtype)
    return PackedLinear4(qw, bias, dtype)


def packed_module(
    fmt: PackedFormat, qw: Quantized, bias: torch.Tensor | None, dtype: torch.dtype
) -> nn.Module:
    if fmt.bits == 4:
        return int4_linear(qw, bias, dtype)
    return (PackedLinear8Grouped if fmt.group_size else PackedLinear8)(qw, bias, dtype)

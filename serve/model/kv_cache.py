"""The paged KV cache's tensors: float, or int8 with a scale per (slot, KV head).

Model: each layer keeps K and V as [num_blocks, block_size, kv_heads, head_dim]. A float cache
stores the model's dtype. An int8 cache (`kv_cache_dtype: int8`, as vLLM's `--kv-cache-dtype`)
stores symmetric codes `round(x / s)` in -127 .. 127 with `s = max|x| / 127` over the head dim
of one token and one KV head (a float32 scale per slot and head, [num_blocks, block_size,
kv_heads]): 1 + 4 / head_dim bytes a value instead of 4 (float32) or 2 (bfloat16). Keys and
values are quantized as they are written (`write_slots`) and read back as `codes * s`: the SDPA
and reference backends dequantize what they gather (`Int8KV.index_select`), the paged CPU kernel
reads the codes and scales in place.

Keys of models that normalise them per channel (a `k_norm`: Gemma 3, Qwen3, OLMo 2) carry the
norm's gain: on Gemma 3 270M a few channels are 20-100x the median, so one scale per vector left
the others a few levels (KL 0.020 against the float cache, 93% top-1 agreement). Such keys are
divided per channel by `key_smoothing` (the gain, shared by each rotary pair, rounded to a power
of two: exact to divide and multiply by) before they are rounded, and the queries that read them
are multiplied by it, so `q . k` is unchanged (KL 0.0047, 97%); keys without a `k_norm` are
stored as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.core.config import KVCacheDtype

INT8_MAX = 127
TINY = 1e-30


@dataclass(frozen=True)
class Int8KV:
    """One layer's K (or V) cache in int8: the value of slot t, head h is `data[t, h] *
    scales[t, h]` (slots flattened over blocks)."""

    data: torch.Tensor
    """[num_blocks, block_size, kv_heads, head_dim] int8."""
    scales: torch.Tensor
    """[num_blocks, block_size, kv_heads] float32."""
    dtype: torch.dtype
    """What reads dequantize into: the model's dtype."""
    smoothing: torch.Tensor | None = None
    """[head_dim] float32 powers of two the stored vectors were divided by (a key cache of a
    model with a `k_norm`; `key_smoothing`): reads multiply it back, the paged kernel multiplies
    the queries by it instead."""

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def index_select(self, dim: int, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks `blocks` (dim 0) dequantized: [len(blocks), block_size, kv_heads, head_dim]
        in `dtype`, as `Tensor.index_select` gives a float cache's."""
        if dim != 0:
            raise ValueError("an int8 KV cache is read by whole blocks (dim 0)")
        codes, scales = self.data.index_select(0, blocks), self.scales.index_select(0, blocks)
        return dequantize_int8(codes, scales, self.dtype, self.smoothing)

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize `x` [len(slots), kv_heads, head_dim] into flat slots `slots`."""
        codes, scales = quantize_int8(x, self.smoothing)
        heads, dim = self.data.shape[2], self.data.shape[3]
        self.data.view(-1, heads, dim).index_copy_(0, slots, codes)
        self.scales.view(-1, heads).index_copy_(0, slots, scales)


KVTensor = torch.Tensor | Int8KV
"""One layer's K or V cache as the backends read it."""


def quantize_int8(
    x: torch.Tensor, smoothing: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] -> (int8 codes [..., head_dim], float32 scales [...]): symmetric, one
    scale per vector, `max|x| / 127` (an all-zero vector: codes 0 under a tiny scale); with
    `smoothing` [head_dim] (on `x`'s device), of `x / smoothing`."""
    x = x.float() if smoothing is None else x.float() / smoothing
    scales = x.abs().amax(-1, keepdim=True).clamp_min_(TINY).div_(INT8_MAX)
    return torch.round(x / scales).to(torch.int8), scales.squeeze(-1)


def dequantize_int8(
    codes: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    smoothing: torch.Tensor | None = None,
) -> torch.Tensor:
    """`quantize_int8`'s inverse: codes [..., head_dim] x scales [...] (x `smoothing`), in
    `dtype`."""
    x = codes.float() * scales.unsqueeze(-1)
    return (x if smoothing is None else x * smoothing).to(dtype)


def key_smoothing(attention: torch.nn.Module) -> torch.Tensor | None:
    """Per-channel divisors for an attention layer's keys before int8 rounding: its `k_norm`'s
    gain (the norm applied to a vector of ones), the root mean square of each rotary pair's two
    gains (rotate-half pairs c and c + head_dim / 2 exchange magnitude with position), rounded
    to a power of two; None for a layer without a `k_norm`."""
    norm = getattr(attention, "k_norm", None)
    weight = getattr(norm, "weight", None)
    if norm is None or weight is None:
        return None
    head_dim = weight.shape[-1]
    with torch.no_grad():
        gain = norm(torch.ones(head_dim, dtype=weight.dtype, device=weight.device)).float().abs()
    half = head_dim // 2
    pair = ((gain[:half] ** 2 + gain[half : 2 * half] ** 2) / 2).sqrt()
    gain = torch.cat([pair, pair, gain[2 * half :]])
    return torch.exp2(torch.round(torch.log2(gain.clamp_min(2.0**-20))))


def write_slots(cache: KVTensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store a step's keys or values `x` [T, kv_heads, head_dim] into flat slots `slots` [T]."""
    if isinstance(cache, Int8KV):
        cache.write(slots, x)
    else:
        cache.view(-1, x.shape[1], x.shape[2]).index_copy_(0, slots, x)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    """The model's dtype: what attention computes in."""
    kv_cache_dtype: KVCacheDtype = "auto"
    """auto: the cache stores `dtype`; int8: codes and a float32 scale per (token, KV head)."""

    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv heads x (head dim x dtype bytes, or head dim + a float32
        scale in int8)."""
        per_head = (
            self.head_dim + 4
            if self.kv_cache_dtype == "int8"
            else self.head_dim * self.dtype.itemsize
        )
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def stored_as(self) -> str:
        """What the cache holds: int8, or the model's dtype (float32, bfloat16, ...)."""
        return "int8" if self.kv_cache_dtype == "int8" else str(self.dtype).removeprefix("torch.")


def allocate(
    layout: KVLayout,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    key_smoothing: dict[int, torch.Tensor | None] | None = None,
) -> list[tuple[KVTensor, KVTensor]]:
    """Per layer a zeroed (K, V) pair, each [num_blocks, block_size, kv_heads, head_dim]; an
    int8 layer's keys divided by `key_smoothing[layer]` where given (`layer_key_smoothing`)."""
    shape = (num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
    smoothing = key_smoothing or {}

    def one(smooth: torch.Tensor | None = None) -> KVTensor:
        if layout.kv_cache_dtype == "int8":
            data = torch.zeros(shape, dtype=torch.int8, device=device)
            scales = torch.ones(shape[:3], device=device)
            on_device = smooth.to(device) if smooth is not None else None
            return Int8KV(data, scales, layout.dtype, on_device)
        return torch.zeros(shape, dtype=layout.dtype, device=device)

    return [(one(smoothing.get(i)), one()) for i in range(layout.num_layers)]


def layer_key_smoothing(model: torch.nn.Module) -> dict[int, torch.Tensor | None]:
    """`key_smoothing` of each attention layer of a transformers model, by `layer_idx`."""
    layers = ((getattr(m, "layer_idx", None), m) for m in model.modules() if hasattr(m, "k_proj"))
    return {i: key_smoothing(m) for i, m in layers if isinstance(i, int)}

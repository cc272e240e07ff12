"""Paged attention as two padded SDPA calls a layer: every decode of the step in one, every
prefill chunk in the other (`padded-sdpa`).

Model: each batch of `serve/model/query_batches.py` gathers its sequences' blocks into
`[B, kv_heads, W * block_size, head_dim]` (an int8 cache dequantized as it is gathered), pads the
queries to `[B, heads, max_query_len, head_dim]`, and masks with `visible` (causal, context,
sliding window). One call per kind, whatever the lengths: the fallback on CUDA where FlexAttention
is unavailable, and the simplest path to check it against. Every key of the W blocks is read
and scored (no block skipping): FlexAttention reads only the blocks a query block can see.

NOTE: no host sync; the shapes follow from (B, max_query_len, W), so the decode call can be
captured in a CUDA graph (W the table width: the engine's fixed blocks per sequence).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from serve.model.attention import AttentionMetadata
from serve.model.kv_cache import KVTensor
from serve.model.query_batches import PerForward, QueryBatch, step_batches, visible
from serve.model.sdpa_attention import gather_batch


def padded_mask(batch: QueryBatch, num_keys: int, window: int | None) -> torch.Tensor:
    """[B, 1, max_query_len, num_keys]: which gathered keys each padded query sees; a padding
    row sees key 0 only (its output is discarded; a row seeing nothing would be NaN)."""
    offsets = torch.arange(batch.max_query_len, device=batch.starts.device)
    q_pos = batch.context_lens[:, None, None] + offsets[None, :, None]
    k_pos = torch.arange(num_keys, device=batch.starts.device)[None, None, :]
    mask = visible(q_pos, k_pos, batch.seq_lens[:, None, None], window)
    padding = offsets[None, :, None] >= batch.query_lens[:, None, None]
    return (mask & ~padding | padding & (k_pos == 0))[:, None]


def attend_padded(
    q: torch.Tensor,
    k_cache: KVTensor,
    v_cache: KVTensor,
    batch: QueryBatch,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """One batch's queries of q [T, heads, head_dim] -> [B, heads, max_query_len, head_dim]."""
    k = gather_batch(k_cache, batch.block_tables)
    v = gather_batch(v_cache, batch.block_tables)
    mask = padded_mask(batch, k.shape[2], window)
    return F.scaled_dot_product_attention(
        batch.gather_queries(q), k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )


class PaddedSDPABackend:
    decode_group_size: int | None = None

    static_decodes = True

    def __init__(self) -> None:
        self._batches = PerForward(step_batches)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: KVTensor,
        v_cache: KVTensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        out = q.new_empty(q.shape[0] + 1, *q.shape[1:])
        for batch in self._batches.get(meta, k_cache):
            if batch is not None:
                o = attend_padded(q, k_cache, v_cache, batch, scale, window)
                batch.scatter_outputs(out, o)
        return out[:-1]

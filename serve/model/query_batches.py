"""A step's sequences as two padded batches, decodes and prefill chunks, for backends that attend
each kind in one call.

Model: sequence b of a batch owns flat rows `starts[b] .. starts[b] + query_lens[b] - 1`; its
queries are the last `query_lens[b]` positions of a `seq_lens[b]`-token context (`context_lens`
tokens were in the cache before this step). Padded to the batch's longest query (`max_query_len`),
the queries form a `[B, heads, max_query_len, head_dim]` tensor; padding rows are read from the
last flat row and their outputs go to a spare row past the batch, so the shapes follow only from
(B, max_query_len) and nothing is read back to the host (CUDA graphs can capture it).

`visible` is the one definition of which keys a query sees (causal, within the context, inside
a sliding window), shared by the FlexAttention mask and the padded-SDPA mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch.nn.utils.rnn import pad_sequence

from serve.model.attention import AttentionMetadata
from serve.model.kv_cache import KVTensor

T = TypeVar("T")


@dataclass(frozen=True)
class QueryBatch:
    starts: torch.Tensor
    """[B] int64: first flat row of each sequence's queries."""
    query_lens: torch.Tensor
    """[B] int64: queries of each sequence this step (decodes: 1)."""
    seq_lens: torch.Tensor
    """[B] int64: tokens in context once this step's are written."""
    block_tables: torch.Tensor
    """[B, W] int64: each sequence's blocks, padded (with block 0) past its last."""
    max_query_len: int
    """The longest `query_lens` (a host int: the padded query length)."""

    @property
    def size(self) -> int:
        return self.starts.shape[0]

    @property
    def context_lens(self) -> torch.Tensor:
        """[B]: tokens cached before this step (the first query's position)."""
        return self.seq_lens - self.query_lens

    def query_rows(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, max_query_len] flat row of each padded query, clamped into the step's
        `num_rows`; [B, max_query_len] True where it is a real query)."""
        offsets = torch.arange(self.max_query_len, device=self.starts.device)
        rows = self.starts[:, None] + offsets[None, :]
        return rows.clamp_(max=num_rows - 1), offsets[None, :] < self.query_lens[:, None]

    def gather_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, heads, head_dim] -> [B, heads, max_query_len, head_dim]."""
        rows, _ = self.query_rows(q.shape[0])
        return q[rows].transpose(1, 2)

    def scatter_outputs(self, out: torch.Tensor, o: torch.Tensor) -> None:
        """Write o [B, heads, max_query_len, head_dim] into `out` [T + 1, heads, head_dim] at
        each real query's row (padding rows into the spare row T)."""
        rows, real = self.query_rows(out.shape[0] - 1)
        spare = torch.full_like(rows, out.shape[0] - 1)
        out.index_put_((torch.where(real, rows, spare),), o.transpose(1, 2).to(out.dtype))


def visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    seq_len: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """True where a query at `q_pos` sees the key at `k_pos` (broadcast elementwise): keys at
    or before it and inside its `seq_len`-token context; with a window, only the last
    `window` of those (positions q_pos - window + 1 .. q_pos)."""
    seen = (k_pos <= q_pos) & (k_pos < seq_len)
    return seen if window is None else seen & (k_pos > q_pos - window)


def step_batches(meta: AttentionMetadata) -> tuple[QueryBatch | None, QueryBatch | None]:
    """The step's (decodes, prefill chunks), each as one batch (None: none of that kind): slices
    of the step's flat tables where it has them (decodes first), else from its per-sequence
    structures (metadata made by hand)."""
    if meta.query_start_loc is None:
        return _decode_batch(meta), _prefill_batch(meta)
    assert meta.seq_lens is not None and meta.block_tables is not None
    assert meta.query_lens is not None
    nd, s = meta.num_decodes, meta.seq_lens.shape[0]

    def rows(first: int, end: int, max_query_len: int) -> QueryBatch:
        return QueryBatch(
            starts=meta.query_start_loc[first:end],  # type: ignore[index]
            query_lens=meta.query_lens[first:end],  # type: ignore[index]
            seq_lens=meta.seq_lens[first:end],  # type: ignore[index]
            block_tables=meta.block_tables[first:end, : _prefill_width(meta, first)],  # type: ignore[index]
            max_query_len=max_query_len,
        )

    return (rows(0, nd, 1) if nd else None), (rows(nd, s, meta.max_query_len) if s > nd else None)


def _prefill_width(meta: AttentionMetadata, first: int) -> int | None:
    """Table columns a prefill batch reads: up to its longest context (host ints of an eager
    step); None (every column) for decodes, whose lengths only the device holds."""
    if first < meta.num_decodes or not meta.prefills:
        return None
    block_size = meta.kv_caches[0][0].shape[1]
    return -(-max(s.seq_len for s in meta.prefills) // block_size)


class PerForward(Generic[T]):
    """A value built from a step's metadata by the first layer of each forward and kept for the
    others. A new forward is told by its first layer's cache, not by the metadata object: a
    captured decode graph's stand-in replays the same metadata over refilled buffers."""

    def __init__(self, build: Callable[[AttentionMetadata], T]) -> None:
        self.build = build
        self._value: tuple[AttentionMetadata, T] | None = None

    def get(self, meta: AttentionMetadata, k_cache: KVTensor) -> T:
        first_layer = k_cache is meta.kv_caches[0][0]
        if first_layer or self._value is None or self._value[0] is not meta:
            self._value = (meta, self.build(meta))
        return self._value[1]


def _decode_batch(meta: AttentionMetadata) -> QueryBatch | None:
    groups = meta.decodes
    if not groups:
        return None
    width = max(g.block_tables.shape[1] for g in groups)

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts).long() if len(parts) > 1 else parts[0].long()

    tables = [
        torch.nn.functional.pad(g.block_tables, (0, width - g.block_tables.shape[1]))
        for g in groups
    ]
    starts = cat([g.rows for g in groups])
    return QueryBatch(
        starts=starts,
        query_lens=torch.ones_like(starts),
        seq_lens=cat([g.seq_lens for g in groups]),
        block_tables=cat(tables),
        max_query_len=1,
    )


def _prefill_batch(meta: AttentionMetadata) -> QueryBatch | None:
    chunks = meta.prefills
    if not chunks:
        return None
    device = chunks[0].block_ids.device

    def as_long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    lens = [s.end - s.start for s in chunks]
    return QueryBatch(
        starts=as_long([s.start for s in chunks]),
        query_lens=as_long(lens),
        seq_lens=as_long([s.seq_len for s in chunks]),
        block_tables=pad_sequence([s.block_ids.long() for s in chunks], batch_first=True),
        max_query_len=max(lens),
    )

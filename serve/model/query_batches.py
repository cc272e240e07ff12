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

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from serve.model.attention import AttentionMetadata


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
    """The step's (decodes, prefill chunks), each as one batch (None: none of that kind)."""
    return _decode_batch(meta), _prefill_batch(meta)


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

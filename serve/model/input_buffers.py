"""Persistent step inputs: the buffers every forward reads, refilled each step in place.

Model: each index tensor a step's forward reads (input ids, positions, slot mapping, sequence
lengths, query starts and lengths, block tables) lives in one buffer allocated once, sized by
the engine's limits: `max_num_tokens` rows, `max_num_seqs` sequences, `max_blocks_per_seq` table
columns. A step writes its values into host staging through numpy views (pinned memory on CUDA)
and copies each used prefix to the device with one non-blocking copy; the forward reads views of
the device buffers, whose `data_ptr()` never change, which is what a captured CUDA graph replays
against. On the CPU the staging is the device buffer: no copy at all.

NOTE: rows past a step's counts keep whatever an earlier step left; every consumer reads only
the prefix a step filled, except that block-table rows are always padded with the null block
(0) out to `max_blocks_per_seq`, and `pad_decodes` fills a graph bucket's extra rows with the
null block's slots, so a padded row reads and writes nothing a request owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from serve.core.block_pool import NULL_BLOCK_ID
from serve.core.scheduler import ScheduledChunk


@dataclass(frozen=True)
class BufferLimits:
    max_num_tokens: int
    """Rows of one step (the token budget; at least the largest graph bucket)."""
    max_num_seqs: int
    """Sequences of one step."""
    max_blocks_per_seq: int
    """Block-table columns: the blocks of the longest context a request can hold."""


@dataclass(frozen=True)
class StepCounts:
    """What a fill wrote: the prefix of each buffer the step reads."""

    num_tokens: int
    num_seqs: int
    num_decodes: int
    """Sequences 0 .. num_decodes - 1 compute one token each, at rows 0 .. num_decodes - 1."""
    max_query_len: int


_FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "query_lens", "query_start_loc")


class StepBuffers:
    """The persistent buffers of one model runner (`fill` them, then read the device views)."""

    def __init__(self, limits: BufferLimits, block_size: int, device: torch.device) -> None:
        self.limits, self.block_size, self.device = limits, block_size, device
        t, s, w = limits.max_num_tokens, limits.max_num_seqs, limits.max_blocks_per_seq
        shapes = {
            "input_ids": (t,),
            "positions": (t,),
            "slot_mapping": (t,),
            "seq_lens": (s,),
            "query_lens": (s,),
            "query_start_loc": (s + 1,),
            "block_tables": (s, w),
        }
        pinned = device.type == "cuda"
        self.host = {
            name: torch.zeros(shape, dtype=torch.long, pin_memory=pinned)
            for name, shape in shapes.items()
        }
        self.np = {name: tensor.numpy() for name, tensor in self.host.items()}
        on_device = device.type != "cpu"
        self.dev = {
            name: tensor.to(device) if on_device else tensor for name, tensor in self.host.items()
        }
        self.rows = torch.arange(s, dtype=torch.long, device=device)
        """0 .. max_num_seqs - 1: the decode rows of any step (decodes come first)."""
        self._table_widths = np.zeros(s, dtype=np.int64)
        """Columns of each block-table row that may hold a non-null block."""

    def fill(self, chunks: list[ScheduledChunk]) -> StepCounts:
        """Write `chunks` (decodes first: see `decodes_first`) into the buffers and copy them to
        the device; what was written."""
        t = sum(len(c.token_ids) for c in chunks)
        self._check_fits(t, len(chunks))
        num_decodes = next((i for i, c in enumerate(chunks) if len(c.token_ids) != 1), len(chunks))
        self._fill_decodes(chunks[:num_decodes])
        row = num_decodes
        for i in range(num_decodes, len(chunks)):
            row = self._fill_chunk(i, row, chunks[i])
        self.np["query_start_loc"][len(chunks)] = t
        for i, chunk in enumerate(chunks):
            self._fill_table(i, chunk.block_ids)
        longest = max((len(c.token_ids) for c in chunks), default=0)
        counts = StepCounts(t, len(chunks), num_decodes, longest)
        self._upload(counts)
        return counts

    def _check_fits(self, num_tokens: int, num_seqs: int) -> None:
        limits = self.limits
        if num_tokens > limits.max_num_tokens or num_seqs > limits.max_num_seqs:
            raise ValueError(
                f"a step of {num_tokens} tokens in {num_seqs} sequences exceeds the step buffers "
                f"({limits.max_num_tokens} tokens, {limits.max_num_seqs} sequences)"
            )

    def _fill_decodes(self, chunks: list[ScheduledChunk]) -> None:
        n, bs = len(chunks), self.block_size
        if not n:
            return
        starts = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=n)
        blocks = np.fromiter(
            (c.block_ids[c.start_pos // bs] for c in chunks), dtype=np.int64, count=n
        )
        a = self.np
        a["input_ids"][:n] = np.fromiter((c.token_ids[0] for c in chunks), np.int64, count=n)
        a["positions"][:n] = starts
        a["slot_mapping"][:n] = blocks * bs + starts % bs
        a["seq_lens"][:n] = starts + 1
        a["query_lens"][:n] = 1
        a["query_start_loc"][:n] = np.arange(n)

    def _fill_chunk(self, i: int, row: int, chunk: ScheduledChunk) -> int:
        """Write sequence `i`'s chunk at flat rows from `row`; the row after it."""
        n, start, bs, a = len(chunk.token_ids), chunk.start_pos, self.block_size, self.np
        end = row + n
        positions = np.arange(start, start + n, dtype=np.int64)
        table = np.asarray(chunk.block_ids, dtype=np.int64)
        a["input_ids"][row:end] = chunk.token_ids
        a["positions"][row:end] = positions
        a["slot_mapping"][row:end] = table[positions // bs] * bs + positions % bs
        a["seq_lens"][i] = start + n
        a["query_lens"][i] = n
        a["query_start_loc"][i] = row
        return end

    def _fill_table(self, i: int, block_ids: list[int]) -> None:
        row, n = self.np["block_tables"][i], len(block_ids)
        row[:n] = block_ids
        if self._table_widths[i] > n:
            row[n : self._table_widths[i]] = NULL_BLOCK_ID
        self._table_widths[i] = n

    def pad_decodes(self, num_decodes: int, bucket: int) -> None:
        """Make rows and sequences num_decodes .. bucket - 1 padding (a graph bucket's extra
        rows): token 0 at position 0, written to the null block's first slot, a context of that
        one slot, a block table of null blocks only."""
        a = self.np
        pad = slice(num_decodes, bucket)
        for name in ("input_ids", "positions", "slot_mapping"):
            a[name][pad] = 0
        a["seq_lens"][pad] = 1
        a["query_lens"][pad] = 1
        a["query_start_loc"][num_decodes : bucket + 1] = np.arange(num_decodes, bucket + 1)
        for i in range(num_decodes, bucket):
            self._fill_table(i, [])
        self._upload(StepCounts(bucket, bucket, bucket, 1))

    def _upload(self, counts: StepCounts) -> None:
        if self.device.type == "cpu":
            return
        t, s = counts.num_tokens, counts.num_seqs
        for name in _FIELDS:
            n = t if name in ("input_ids", "positions", "slot_mapping") else s
            n += name == "query_start_loc"
            self.dev[name][:n].copy_(self.host[name][:n], non_blocking=True)
        self.dev["block_tables"][:s].copy_(self.host["block_tables"][:s], non_blocking=True)

    def view(self, name: str, n: int) -> torch.Tensor:
        """The first `n` entries (rows) of device buffer `name`."""
        return self.dev[name][:n]


def decodes_first(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """The step's chunks with the one-token ones first, each group in the scheduler's order
    (usually already so: running requests, which decode, are scheduled before new ones)."""
    decodes = [c for c in chunks if len(c.token_ids) == 1]
    if all(len(c.token_ids) == 1 for c in chunks[: len(decodes)]):
        return chunks
    return decodes + [c for c in chunks if len(c.token_ids) != 1]

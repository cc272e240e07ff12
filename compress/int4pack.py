"""Rows read back from torch's int4 CPU kernel layout, so one copy of 4-bit codes serves both a
tied lm_head (through the kernel) and the embedding lookup (rows dequantized on demand).

Model: `_convert_weight_to_int4pack_for_cpu` turns codes [N, K] into bytes laid out by blocks of
`block_n` rows (64 with AVX-512, 32 otherwise; the last block may be shorter): block `i` starts at
byte `i * K * block_n / 2`, and within it the codes of column `k` fill `nb / 2` bytes (`nb` the
block's rows), two rows per byte. Which two depends on the CPU build: vectorised builds pair row
`d` with row `d + 16` (AVX2) or rows `d, d + 32` and `d + 16, d + 48` (AVX-512) in full blocks;
scalar builds and short blocks pair neighbours. The layout is not part of torch's API, so it is
found by packing a probe and checking each candidate; when none fits, `find_layout` returns
None and the caller keeps its own copy of the codes. `unpack` reads whole blocks of rows at
once (the dequantized matmul of `compress.packed`), `codes` any rows (embedding lookups).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Layout:
    block_n: int
    interleaved: bool
    """Full blocks pair row d with d + 16 (and lanes of 16 rows beyond); False: neighbours."""

    def codes(self, packed: torch.Tensor, rows: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The uint8 codes [len(rows), k] of `rows` of the [n, k] matrix packed as `packed`."""
        rows = rows.reshape(-1).long()
        block, r = rows // self.block_n, rows % self.block_n
        nb = torch.clamp(n - block * self.block_n, max=self.block_n)
        full = (nb == self.block_n) & self.interleaved
        lanes_half = self.block_n // 32  # lanes of 16 rows sharing a byte's low nibbles
        lane, d = r // 16, r % 16
        byte = torch.where(full, d + 16 * (lane % max(lanes_half, 1)), r // 2)
        shift = 4 * torch.where(full, lane // max(lanes_half, 1), r % 2)
        start = block * (k * self.block_n // 2) + byte
        index = start[:, None] + torch.arange(k, device=rows.device)[None, :] * (nb // 2)[:, None]
        return (packed.reshape(-1)[index] >> shift[:, None].to(torch.uint8)) & 0xF

    def unpack(self, packed: torch.Tensor, n: int, k: int, start: int, stop: int) -> torch.Tensor:
        """The uint8 codes [stop - start, k] of rows `start` .. `stop` (`start` a multiple of
        `block_n`): full blocks by reshaping their bytes, a short last block by `codes`."""
        bn = self.block_n
        full_stop = min(stop, n // bn * bn)
        out = []
        if full_stop > start:
            blocks = (full_stop - start) // bn
            at = start * k // 2
            grid = packed.reshape(-1)[at : at + blocks * k * bn // 2].reshape(blocks, k, bn // 2)
            low, high = grid & 0xF, grid >> 4
            if self.interleaved:  # a block's first half of rows in low nibbles, the rest high
                rows = torch.cat([low, high], dim=2)
            else:  # neighbours: even rows low, odd rows high
                rows = torch.stack([low, high], dim=3).reshape(blocks, k, bn)
            out.append(rows.transpose(1, 2).reshape(blocks * bn, k))
        if stop > max(full_stop, start):
            tail = torch.arange(max(full_stop, start), stop, device=packed.device)
            out.append(self.codes(packed, tail, n, k))
        return out[0] if len(out) == 1 else torch.cat(out)


CANDIDATES = (Layout(64, True), Layout(32, True), Layout(32, False), Layout(64, False))


@functools.cache
def find_layout() -> Layout | None:
    """The candidate that reads back a probe packed by this torch build, or None."""
    generator = torch.Generator().manual_seed(0)
    n, k = 2 * 64 + 16, 64  # two full blocks of either size and a short one
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    rows = torch.arange(n)
    for layout in CANDIDATES:
        read = layout.codes(packed, rows, n, k).int()
        if torch.equal(read, codes) and torch.equal(layout.unpack(packed, n, k, 0, n).int(), codes):
            return layout
    return None

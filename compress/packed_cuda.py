"""Packed int4 weights on CUDA through torch's tinygemm kernel (`_weight_int4pack_mm`).

Model: tinygemm multiplies bfloat16 activations [m, k] by int4 codes held in the layout of the
m16n8k16 tensor-core B operand, with one bfloat16 scale `s` and offset `m` per group of
`group_size` input features and output row: its weight is `(q - 8) * s + m` (each product in
bfloat16, the sums in float32, the output rounded to bfloat16). Ours is `(q - z) * s`, so
`m = (8 - z) * s`: the convention of torch's int4 CPU kernel too (`kernel_scales_and_zeros`).
- The layout (`_convert_weight_to_int4pack` on CUDA, written out here as plain tensor code, so
  it is built and tested on the CPU): int32 words [n / 8, k / (16 * inner_k_tiles), 32 lanes,
  inner_k_tiles / 2]. Lane `t` of row tile `nt` holds row `8 * nt + t // 4`; word `j` of k
  tile group `ko` holds k tiles `ko * inner_k_tiles + 2j` and `+ 1`; its nibble `p` (bits
  `4p .. 4p + 3`) holds the code of column `16 * tile + 8 * (i % 2) + 2 * (t % 4) + p // 4`,
  with `i = p % 4` and `tile = ko * inner_k_tiles + 2j + i // 2`. That is the B fragment of
  `mma.m16n8k16`: each 32-bit half of the kernel's dequantized registers holds the two
  neighbouring k rows `2 * (t % 4)`, `+ 1` (and `+ 8`, `+ 9`) of column `t // 4`.
- Rows are padded to a multiple of 8 with zero scales and offsets (their outputs are dropped);
  `in_features` is a multiple of the group size, so of 32, which `inner_k_tiles` 2 divides.
- tinygemm needs compute capability 8.0 (bfloat16 tensor cores) and NVIDIA's CUDA (ROCm builds
  lay the operand out in tiles of 16 rows): elsewhere `compress.packed` keeps dequantizing.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

N_TILE = 8
"""Rows of one tinygemm tile."""
K_TILE = 16
"""Input features of one tinygemm k tile."""
LAYOUT_ROWS = 4096
"""Rows converted at once (bounds the int64 temporary of a 128k-row head)."""


def tinygemm_runs(device: torch.device) -> bool:
    """Whether torch's tinygemm int4 kernel runs on `device`."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def int8_kernel_runs(device: torch.device) -> bool:
    """Whether torch's `_weight_int8pack_mm` has a kernel for `device` (CUDA builds do)."""
    if device.type != "cuda":
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", "CUDA")


def inner_k_tiles(in_features: int) -> int:
    """k tiles per lane word: the largest of 8, 4, 2 whose span (16 features each) divides
    `in_features` (8: 16-byte loads)."""
    for tiles in (8, 4, 2):
        if in_features % (tiles * K_TILE) == 0:
            return tiles
    raise ValueError(f"tinygemm needs in_features a multiple of 32, not {in_features}")


@functools.cache
def _columns(in_features: int, tiles: int) -> torch.Tensor:
    """The column each nibble of a row's words holds: [k / (16 * tiles), 4 (t % 4), tiles / 2,
    8 nibbles], a permutation of 0 .. in_features - 1 (see the module's model)."""
    outer = in_features // (tiles * K_TILE)
    ko = torch.arange(outer)[:, None, None, None]
    t4 = torch.arange(4)[None, :, None, None]
    j = torch.arange(tiles // 2)[None, None, :, None]
    p = torch.arange(8)[None, None, None, :]
    i = p % 4
    tile = ko * tiles + 2 * j + i // 2
    return K_TILE * tile + 8 * (i % 2) + 2 * t4 + p // 4


def padded_rows(out_features: int) -> int:
    return -(-out_features // N_TILE) * N_TILE


def tinygemm_layout(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [n, k] (0 .. 15) as tinygemm's int32 operand [ceil(n / 8), k / (16 *
    inner_k_tiles), 32, inner_k_tiles / 2], on the codes' device."""
    n, k = codes.shape
    tiles = inner_k_tiles(k)
    rows = padded_rows(n)
    padded = codes.new_full((rows, k), 8, dtype=torch.uint8)
    padded[:n] = codes
    cols = _columns(k, tiles).to(codes.device)
    parts = [_words(padded[a : a + LAYOUT_ROWS], cols) for a in range(0, rows, LAYOUT_ROWS)]
    return torch.cat(parts)


def _words(codes: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Rows (a multiple of 8) of codes as their int32 words (see `tinygemm_layout`)."""
    outer, _, half_tiles, _ = cols.shape
    tiles = codes.shape[0] // N_TILE
    nibbles = codes.view(tiles, N_TILE, -1)[:, :, cols.reshape(-1)]
    nibbles = nibbles.view(tiles, N_TILE, outer, 4, half_tiles, 8).permute(0, 2, 1, 3, 4, 5)
    shifts = 4 * torch.arange(8, device=codes.device)
    words = (nibbles.reshape(tiles, outer, 32, half_tiles, 8).long() << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def tinygemm_rows(packed: torch.Tensor, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """The uint8 codes [len(rows), in_features] of `rows`, read back from tinygemm's operand."""
    tiles, outer, _, half_tiles = packed.shape
    rows = rows.reshape(-1).long()
    lanes = packed.view(tiles, outer, N_TILE, 4, half_tiles)
    words = lanes[rows // N_TILE, :, rows % N_TILE]  # [len(rows), outer, 4, half_tiles]
    shifts = 4 * torch.arange(8, device=packed.device)
    nibbles = (words.long()[..., None] >> shifts) & 0xF
    out = torch.empty(rows.numel(), in_features, dtype=torch.uint8, device=packed.device)
    out[:, _columns(in_features, 2 * half_tiles).to(packed.device).reshape(-1)] = nibbles.reshape(
        rows.numel(), -1
    ).to(torch.uint8)
    return out


def kernel_scales_and_zeros(
    scales: torch.Tensor, zeros: torch.Tensor, rows: int | None = None
) -> torch.Tensor:
    """Our `(q - z) * s` grids [out, groups] as torch's int4 kernels read them: [groups, rows,
    (s, (8 - z) * s)] in bfloat16, rows past `out` (to `rows`) zero."""
    offsets = (8 - zeros) * scales
    sz = torch.stack([scales.t(), offsets.t()], dim=-1)
    return padded_to(sz, rows or sz.shape[1]).to(torch.bfloat16)


def padded_to(scales_and_zeros: torch.Tensor, rows: int) -> torch.Tensor:
    """[groups, out, 2] scales and offsets with zero rows up to `rows`, contiguous."""
    groups, out, _ = scales_and_zeros.shape
    if rows > out:
        pad = scales_and_zeros.new_zeros(groups, rows - out, 2)
        scales_and_zeros = torch.cat([scales_and_zeros, pad], dim=1)
    return scales_and_zeros.contiguous()


def int4pack_mm(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """tinygemm's product: bfloat16 x [m, k] by the operand, [m, padded rows] bfloat16."""
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)


class TinygemmLinear4(nn.Module):
    """int4 weight on CUDA, float activations: `x @ ((q - z) * s).T (+ bias)` through tinygemm
    (activations cast to bfloat16 in, the output cast back to the model's dtype)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scales.shape[1]
        rows = padded_rows(self.out_features)
        self.register_buffer("packed", tinygemm_layout(q), persistent=False)
        sz = kernel_scales_and_zeros(scales, zeros, rows)
        self.register_buffer("scales_and_zeros", sz, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    @classmethod
    def from_kernel_operands(
        cls, codes: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None
    ) -> TinygemmLinear4:
        """Over codes [out, in] and scales and offsets already in the int4 kernels' convention
        ([groups, out, (s, m)] bfloat16: torch's CPU kernel reads the same), bias kept."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features = codes.shape
        self.group_size = self.in_features // scales_and_zeros.shape[0]
        sz = padded_to(scales_and_zeros, padded_rows(self.out_features))
        self.register_buffer("packed", tinygemm_layout(codes), persistent=False)
        self.register_buffer("scales_and_zeros", sz, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if flat.shape[0]:
            y = int4pack_mm(flat, self.packed, self.group_size, self.scales_and_zeros)
        else:  # NOTE: a launch over no rows is an invalid CUDA grid (a step sampling nothing)
            y = flat.new_empty(0, self.scales_and_zeros.shape[1])
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows `ids` in float32 [*ids.shape, in_features] as the kernel reads them:
        `(q - 8) * s + m` with its bfloat16 scales and offsets."""
        flat = ids.reshape(-1)
        codes = tinygemm_rows(self.packed, flat, self.in_features).float()
        sz = self.scales_and_zeros[:, flat].float().transpose(0, 1)  # [rows, groups, (s, m)]
        grouped = codes.reshape(flat.numel(), sz.shape[1], self.group_size) - 8
        out = grouped * sz[..., :1] + sz[..., 1:]
        return out.reshape(*ids.shape, self.in_features)

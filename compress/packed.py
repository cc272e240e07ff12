"""Packed integer weights: the stored format of calibrated quantization, and the modules that
serve it.

Model: a quantized linear keeps integer codes `q` (0 .. 2^bits - 1), and per output row and group
of `group_size` input features a scale `s` and a float zero point `z`: its weight is
`(q - z) * s`. A float zero point covers asymmetric GPTQ / RTN (an integer z) and HQQ (a
fitted one) alike.
- int4 (`group_size` 32 / 64 / 128 / 256) runs through torch's int4 CPU kernel
  (`_weight_int4pack_mm_for_cpu`: weight `(q - 8) * s + m`, so `m = (8 - z) * s`), the weight
  staying 4-bit in memory.
- int8 per output channel (`group_size` None) runs through torch's int8 kernel
  (`_weight_int8pack_mm`) on `q - 128`, plus `x.sum(-1) * (128 - z) * s` when `z` is not 128.
  int8 in groups (32 .. 256: llama.cpp's Q8_0 is symmetric groups of 32), which no torch kernel
  runs, is dequantized per call in the activations' dtype (float32 on the CPU, so no bfloat16
  rounding: the accurate int8, not the fast one), a bounded slice of rows at a time.
- NOTE: on the CPU both kernels compute in bfloat16 (activations cast in, the output cast back,
  scales rounded to bfloat16), whatever the model's dtype: torch's float32 paths of these kernels
  are not vectorised (measured: 40x slower than bfloat16 at 2,048 rows). torchao's int4 CPU
  tensor (the `int4-wo` method) does the same. The engine and `generate` run the same modules;
  the tests' models stay token-exact, but the kernels' bf16 rounding can depend on how many rows
  a call has, so a near tie on a real model can flip (seen once on Gemma 3: an xfail test).
- Calls of at least `dequantize_rows` rows (prefill chunks, evaluation batches: 64 where
  bfloat16 is emulated, 64-1,024 by kind where it is native and the kernels fast) skip the CPU
  kernels: the weight is dequantized a bounded slice of rows at a time (from the kernel's own
  bfloat16 scales) and multiplied in float32, with the activations and the output rounded to
  bfloat16 as the kernels round them. Same numbers up to float32 summation order, about twice
  as fast at those shapes on a CPU without native bfloat16; decode-sized calls keep the kernels,
  which read 4 / 8 bits a weight. A bfloat16 model on a CPU with native bfloat16 products
  (`bf16_products`) multiplies those calls in bfloat16 instead, 2.2x float32's speed at 64-1,024
  rows (avx512_bf16, SmolLM2's shapes): int8 codes are exact in bfloat16 (the per-channel
  scale is applied to the product), int4 weights `(q - 8) * s + m` are rounded to bfloat16
  (relative error 2^-9, as the bfloat16 model's own weights; a 4-bit step is 2^-4 of a group's
  range).
- On CUDA int4 runs through torch's tinygemm kernel (`_weight_int4pack_mm`, bfloat16
  activations: `compress.packed_cuda.TinygemmLinear4`, the same `(q - 8) * s + m` with
  bfloat16 scales and offsets), int8 per output channel through `_weight_int8pack_mm` for calls
  of up to `CUDA_INT8_KERNEL_ROWS` rows (the rest, and int8 groups, dequantize per call in the
  model's dtype). On other devices (and GPUs older than sm80) both dequantize per call in the
  model's dtype (correct, not fast).
- An embedding may be int8 per row or int4 in groups (`compress.packed_modules`: a table
  lookup dequantizes the rows it reads); a tied `lm_head` then reads the same codes through the
  kernel, one copy in memory (int4 rows are read back from the kernel's layout:
  `compress.int4pack`).
Stored in safetensors as `<module>.qweight` (uint8; int4 two codes a byte, even column in the low
nibble), `<module>.scales` and `<module>.zeros` (float32, [out, groups]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from compress.int4pack import find_layout
from compress.packed_cuda import (
    int8_kernel_runs,
    kernel_scales_and_zeros,
)

GROUP_SIZES = (32, 64, 128, 256)
DEQUANTIZE_CHUNK = 1 << 22
"""Weights dequantized at once by a grouped int8 linear (16 MiB of float32): bounds the
temporary a large matrix (a 262k-row head) would otherwise need in full."""
KERNEL_DTYPE = torch.bfloat16
"""What the CPU kernels compute in (see the NOTE above)."""
CUDA_INT8_KERNEL_ROWS = 16
"""Rows up to which a CUDA call of an int8 linear runs `_weight_int8pack_mm` (decode steps);
larger calls dequantize and take cuBLAS. Not yet measured on a GPU: the kernel computes each
output from the whole int8 row (a float32 dot per output), so its cost grows with the rows,
while the dequantized product's stays about that of one bfloat16 weight read."""
DEQUANTIZE_ROWS = 64
"""Rows from which a CPU call dequantizes instead of running the kernel. Measured on a 2-core
AVX2 CPU (bfloat16 emulated), Gemma 3's 640 x 2048 shapes: the int4 / int8 kernels take 1.4-1.9x
a float32 matmul's time at 64 rows and 2.0-2.2x at 256-1,024, where dequantizing costs 0.3-2 ms
a matrix; at 16 rows or fewer the kernels are as fast or faster."""
NATIVE_BF16_DEQUANTIZE_ROWS: dict[tuple[int, bool], int] = {
    (4, True): 256,
    (8, True): 64,
    (4, False): 1024,
    (8, False): 1024,
}
"""The same threshold, by (bits, bfloat16 product), where bfloat16 is native and the kernels are
fast. Measured on a 2-core AVX-512 / avx512_bf16 CPU at SmolLM2's 576 x 1,536 shapes (kernel /
dequantized product, ms): int4 and bfloat16 activations 1.42 / 2.50 at 128 rows, 2.70-2.76 /
2.35-3.04 at 256, 5.4 / 3.4-4.5 at 512; int8 0.77-0.83 / 0.59-0.62 at 64; float32 activations
(a float32 product) int4 2.9 / 4.4-5.9 at 256 and 11.3-11.5 / 12.4-12.8 at 1,024 (parity at
2,048), int8 3.0-3.3 / 3.1-3.2 at 256, 11.8-12.7 / 11.5-13.0 at 1,024."""


def dequantize_rows(bits: int, x: torch.Tensor) -> int:
    """Rows from which a CPU call of a `bits` linear on `x` dequantizes instead of running the
    kernel: `DEQUANTIZE_ROWS` where bfloat16 is emulated, `NATIVE_BF16_DEQUANTIZE_ROWS` where it
    is native."""
    if not _native_bf16():
        return DEQUANTIZE_ROWS
    return NATIVE_BF16_DEQUANTIZE_ROWS[bits, bf16_products(x)]


@cache
def _native_bf16() -> bool:
    from compress.training import fast_bf16

    return fast_bf16()


def bf16_products(x: torch.Tensor) -> bool:
    """Whether a dequantized product of the activations `x` multiplies in bfloat16: `x` is
    bfloat16 and this machine runs bfloat16 products natively (`compress.training.fast_bf16`).
    Elsewhere the product widens to float32 (exact up to summation order, and faster where
    bfloat16 is emulated)."""
    return x.dtype == torch.bfloat16 and _native_bf16()


@dataclass(frozen=True)
class PackedFormat:
    """How one module's weight is stored."""

    bits: int
    """4 or 8."""
    group_size: int | None
    """Input features per scale and zero point; None: one per output row (int8 only)."""

    @property
    def name(self) -> str:
        return f"int{self.bits}" + (f"-g{self.group_size}" if self.group_size else "")

    def bits_per_weight(self) -> float:
        """Code bits plus the float32 scale and zero point of each group (or row)."""
        return self.bits + (64 / self.group_size if self.group_size else 0.0)

    @classmethod
    def parse(cls, name: str) -> PackedFormat:
        """`int4-g32` .. `int4-g256`, `int8` (per channel) or `int8-g32` .. `int8-g256`."""
        if name == "int8":
            return cls(8, None)
        bits, _, group = name.partition("-g")
        if bits in ("int4", "int8") and group.isdigit() and int(group) in GROUP_SIZES:
            return cls(int(bits[3:]), int(group))
        raise ValueError(
            f"unknown packed format {name!r}; use int8 (per channel), int8-g32 .. int8-g256, "
            "or int4-g32, int4-g64, int4-g128, int4-g256"
        )


@dataclass(frozen=True)
class Quantized:
    """One weight as codes, scales and zero points: `weight = (q - z) * s`, by group."""

    q: torch.Tensor
    """[out, in] integer codes (uint8)."""
    scales: torch.Tensor
    """[out, groups] float32."""
    zeros: torch.Tensor
    """[out, groups] float32."""

    def dequantize(self) -> torch.Tensor:
        group = self.q.shape[1] // self.scales.shape[1]
        s = self.scales.repeat_interleave(group, dim=1)
        z = self.zeros.repeat_interleave(group, dim=1)
        return (self.q.float() - z) * s


def dequantized_linear(
    x: torch.Tensor, weight_rows: Callable[[int, int], torch.Tensor], out: int, align: int = 1
) -> torch.Tensor:
    """`x @ W.T` for a weight of `out` rows, `weight_rows(start, stop)` giving rows `start` ..
    `stop` dequantized in `x`'s dtype, at most `DEQUANTIZE_CHUNK` weights at a time (slices
    start at multiples of `align`)."""
    rows = max(align, DEQUANTIZE_CHUNK // x.shape[-1] // align * align)
    parts = [F.linear(x, weight_rows(a, min(a + rows, out))) for a in range(0, out, rows)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes as stored: int8 as is, int4 two a byte (even column in the low nibble)."""
    q = q.to(torch.uint8)
    return q if bits == 8 else q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_codes(stored: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return stored
    out = torch.empty(stored.shape[0], stored.shape[1] * 2, dtype=torch.uint8, device=stored.device)
    out[:, 0::2], out[:, 1::2] = stored & 0xF, stored >> 4
    return out


class PackedLinear4(nn.Module):
    """int4 weight, float activations: `x @ ((q - z) * s).T (+ bias)`."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def __init__(self, qw: Quantized, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = qw.q.shape
        self.group_size = self.in_features // qw.scales.shape[1]
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.kernel = qw.q.device.type == "cpu"
        if self.kernel:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32), 1)
            sz = kernel_scales_and_zeros(qw.scales, qw.zeros)
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales_and_zeros", sz, persistent=False)
            self.layout = find_layout()
            if self.layout is None:  # rows cannot be read back from the kernel's bytes
                self.register_buffer("q", qw.q, persistent=False)
        else:
            self.register_buffer("q", qw.q, persistent=False)
            self.register_buffer("scales", qw.scales, persistent=False)
            self.register_buffer("zeros", qw.zeros, persistent=False)

    @classmethod
    def from_kernel_tensors(
        cls,
        packed: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        bias: torch.Tensor | None,
        shape: tuple[int, int],
    ) -> PackedLinear4 | None:
        """A linear of `shape` (out, in) over a weight already in the CPU kernel's layout:
        `packed` codes and `scales_and_zeros` ([groups, out, (s, m)] in bfloat16: torchao's
        `Int4OpaqueTensor` holds the same two tensors, kept here without a copy). None where
        this torch build's layout cannot be read back (`compress.int4pack`: rows could not be
        dequantized) or the tensors are not of that shape (padded)."""
        layout = find_layout()
        out, k = shape
        groups = scales_and_zeros.shape[0]
        fits = packed.numel() * 2 == out * k and scales_and_zeros.shape[1] == out
        if layout is None or not fits or k % groups:
            return None
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.out_features, self.in_features, self.group_size = out, k, k // groups
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kernel, self.layout = True, layout
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE).contiguous()
            dequantize = flat.shape[0] >= dequantize_rows(4, x)
            align = 1 if self.layout is None else self.layout.block_n
            if dequantize and bf16_products(x):
                y = dequantized_linear(flat, self.weight_rows_bf16, self.out_features, align)
            elif dequantize:
                y = dequantized_linear(flat.float(), self.weight_rows, self.out_features, align)
                y = y.to(KERNEL_DTYPE)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    flat, self.packed, self.group_size, self.scales_and_zeros
                )
            y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        else:
            weight = Quantized(self.q, self.scales, self.zeros).dequantize()
            y = F.linear(x, weight.to(x.dtype))
        return y if self.bias is None else y + self.bias

    def weight_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows `start` .. `stop` in float32 as the CPU kernel reads them (`start` a multiple of
        the layout's block)."""
        if self.layout is None:
            codes = self.q[start:stop]
        else:
            codes = self.layout.unpack(
                self.packed, self.out_features, self.in_features, start, stop
            )
        return self._dequantize(codes, self.scales_and_zeros[:, start:stop])

    def codes(self) -> torch.Tensor:
        """Every row's uint8 codes [out, in] (read back from the CPU kernel's bytes)."""
        if not self.kernel or self.layout is None:
            return self.q
        return self.layout.unpack(
            self.packed, self.out_features, self.in_features, 0, self.out_features
        )

    def weight_rows_bf16(self, start: int, stop: int) -> torch.Tensor:
        return self.weight_rows(start, stop).to(torch.bfloat16)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows `ids` dequantized in float32 [*ids.shape, in_features], from what the
        forward reads (on the CPU: the kernel's codes and its bfloat16 scales and offsets)."""
        flat = ids.reshape(-1)
        if not self.kernel:
            qw = Quantized(self.q[flat], self.scales[flat], self.zeros[flat])
            return qw.dequantize().reshape(*ids.shape, self.in_features)
        if self.layout is None:
            codes = self.q[flat]
        else:
            codes = self.layout.codes(self.packed, flat, self.out_features, self.in_features)
        out = self._dequantize(codes, self.scales_and_zeros[:, flat])
        return out.reshape(*ids.shape, self.in_features)

    def _dequantize(self, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        """`(codes - 8) * s + m` in float32, `sz` the kernel's [groups, rows, (s, m)]."""
        sz = sz.float().transpose(0, 1)  # [rows, groups, (scale, offset)]
        scale, offset = sz[..., :1], sz[..., 1:] - 8 * sz[..., :1]
        grouped = codes.reshape(codes.shape[0], sz.shape[1], self.group_size).float()
        return grouped.mul_(scale).add_(offset).reshape(codes.shape)


class _Int8Linear(nn.Module):
    """int8 codes as signed `q - 128`, with scales `s` and offsets `(128 - z) * s` (None when
    every zero point is 128) in whatever shape the subclass reads them."""

    q_signed: torch.Tensor
    scales: torch.Tensor
    offset: torch.Tensor | None

    def __init__(
        self,
        qw: Quantized,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        scales: torch.Tensor,
        offset: torch.Tensor,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qw.q.shape
        self.register_buffer("q_signed", (qw.q.int() - 128).to(torch.int8), persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("offset", offset if offset.any() else None, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)


class PackedLinear8(_Int8Linear):
    """int8 weight per output channel, float activations."""

    def __init__(self, qw: Quantized, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        kernel = qw.q.device.type == "cpu"
        compute = KERNEL_DTYPE if kernel else dtype
        offset = (128 - qw.zeros[:, 0]) * qw.scales[:, 0]
        super().__init__(qw, bias, dtype, qw.scales[:, 0].to(compute), offset.to(compute))
        self.kernel = kernel
        self.cuda_kernel = int8_kernel_runs(qw.q.device)
        """On CUDA: decode-sized calls run `_weight_int8pack_mm` (`CUDA_INT8_KERNEL_ROWS`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scales.dtype).contiguous()
        dequantize = self.kernel and flat.shape[0] >= dequantize_rows(8, x)
        if dequantize and bf16_products(x):
            codes = self.q_signed
            y = dequantized_linear(flat, lambda a, b: codes[a:b].to(flat.dtype), self.out_features)
            y = y * self.scales
        elif dequantize:
            y = dequantized_linear(flat.float(), self.weight_rows, self.out_features).to(flat.dtype)
        elif self.kernel or (self.cuda_kernel and 0 < flat.shape[0] <= CUDA_INT8_KERNEL_ROWS):
            y = torch.ops.aten._weight_int8pack_mm(flat, self.q_signed, self.scales)
        else:
            y = F.linear(flat, self.q_signed.to(flat.dtype) * self.scales[:, None])
        if self.offset is not None:
            y = y + flat.sum(-1, keepdim=True) * self.offset
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def weight_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows `start` .. `stop` in float32 as the kernel reads them: `q_signed * s`."""
        return self.q_signed[start:stop].float() * self.scales[start:stop, None].float()


class PackedLinear8Grouped(_Int8Linear):
    """int8 weight in groups of input features, float activations: no torch kernel runs it, so
    the weight is dequantized per call in the activations' dtype, `DEQUANTIZE_CHUNK` weights at
    a time. Scales and offsets stay float32 [out, groups]."""

    def __init__(self, qw: Quantized, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(qw, bias, dtype, qw.scales.clone(), (128 - qw.zeros) * qw.scales)
        self.groups = qw.scales.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dequantized_linear(x, lambda a, b: self.weight_rows(a, b, x.dtype), self.out_features)
        return y if self.bias is None else y + self.bias

    def weight_rows(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows `start` .. `stop` dequantized in `dtype`: `q_signed * s + (128 - z) * s`."""
        q = self.q_signed[start:stop]
        grouped = q.reshape(q.shape[0], self.groups, -1).to(dtype)
        w = grouped * self.scales[start:stop, :, None].to(dtype)
        if self.offset is not None:
            w = w + self.offset[start:stop, :, None].to(dtype)
        return w.reshape(q.shape)

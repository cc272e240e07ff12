"""bitsandbytes' 4-bit linear layers (nf4, fp4) served by the engine's own CPU kernel.

Model: where bitsandbytes (0.50) has no fused CPU kernel (no AVX512-BF16), a `Linear4bit` call
dequantizes the layer's whole weight to float32 and then runs `F.linear`: SmolLM2-135M in nf4
takes 166 ms a decode step of one sequence against the float32 model's 44. A `FourBitLinear`
keeps the same codes and block scales and runs `kernels/fourbit_linear.c`, which decodes a tile
of rows at a time in cache and multiplies in float32: the weights bitsandbytes dequantizes, bit
for bit, and its products up to the order of the sums. Calls of `DEQUANTIZE_ROWS` rows or more
(prefill chunks, evaluation batches) dequantize a bounded slice of rows at a time and multiply
through `F.linear`, which is faster there.
A layer stays bitsandbytes' where bitsandbytes computes differently (its AVX512-BF16 kernel
multiplies in bfloat16; a compute dtype other than float32) or where the kernel's contract does
not hold (in_features and the block size multiples of 8); `why_kept` says which.
Double-quantized block scales are dequantized once, as bitsandbytes does on every call: 4 bytes
a block of 64 weights in memory instead of about 1.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import torch
from torch import nn

from compress.packed import dequantized_linear
from serve.model.native import KERNELS, load_library

SOURCE = KERNELS / "fourbit_linear.c"
COMPILE = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
"""No -ffast-math: each weight is bitsandbytes' float32 product of its code's value and scale."""
DEQUANTIZE_ROWS = 128
"""Rows from which a call dequantizes slices of the weight and runs `F.linear`. Measured on a
2-core AVX2 CPU at SmolLM2's shapes (576 -> 3,072, 1,536 -> 576): the kernel takes 0.6-0.8x
that path's time at 16 rows, about the same at 64, 1.1-1.8x at 128 and 1.25x at 512-1,024;
bitsandbytes' own call takes 1.5-3x the kernel's time at 1-16 rows."""


@cache
def load_kernel() -> ctypes.CDLL | None:
    """The 4-bit library, built on first use; None (and one log line) where it cannot be."""
    p, i = ctypes.c_void_p, ctypes.c_int64
    signatures = {
        "fourbit_linear": [p, i, i, p, p, p, i, i, p, p],
        "fourbit_dequantize": [p, p, p, i, i, i, i, p],
    }
    return load_library(SOURCE, COMPILE, signatures, "bitsandbytes 4-bit layers kept")


def lookup_table(quant_type: str) -> torch.Tensor:
    """The 16 float32 values bitsandbytes' CPU dequantization gives codes 0 .. 15 (read from
    its own op, so the kernel's weights are the ones bitsandbytes computes)."""
    codes = torch.zeros(32, dtype=torch.uint8)
    codes[:8] = torch.tensor([0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF], dtype=torch.uint8)
    dequantize = torch.ops.bitsandbytes.dequantize_4bit.default
    return dequantize(codes, torch.ones(1), 64, quant_type, (1, 64), torch.float32)[0, :16].clone()


def block_scales(quant_state: Any) -> torch.Tensor:
    """float32 absmax of every block, as bitsandbytes' matmul dequantizes nested ones."""
    absmax = quant_state.absmax
    if quant_state.nested:
        state2 = quant_state.state2
        dequantize = torch.ops.bitsandbytes.dequantize_blockwise.default
        absmax = dequantize(absmax, state2.absmax, state2.code, state2.blocksize, torch.float32)
        absmax = absmax + quant_state.offset
    return absmax.float().contiguous()


def why_kept(module: Any) -> str | None:
    """Why a bitsandbytes `Linear4bit` stays bitsandbytes' own, or None when it can be replaced."""
    weight = module.weight
    qs = getattr(weight, "quant_state", None)
    if qs is None:
        return "it holds no quantized weight yet"
    if weight.device.type != "cpu":
        return "it is not on the CPU"
    if getattr(module, "support_avx512bf16_for_cpu", False):
        return "bitsandbytes runs it through its AVX512-BF16 kernel (in bfloat16)"
    if getattr(qs, "packing_format_for_cpu", False):
        return "bitsandbytes has repacked it for its own CPU kernel"
    if module.compute_dtype != torch.float32:
        return f"it computes in {module.compute_dtype}, the kernel in float32"
    if qs.quant_type not in ("nf4", "fp4"):
        return f"quant type {qs.quant_type!r}"
    _, in_features = qs.shape
    if in_features % 8 or qs.blocksize % 8:
        return f"in_features {in_features} and block size {qs.blocksize} must be multiples of 8"
    return None


class FourBitLinear(nn.Module):
    """A bitsandbytes 4-bit linear (float32 compute) through `kernels/fourbit_linear.c`."""

    codes: torch.Tensor
    absmax: torch.Tensor
    lut: torch.Tensor

    def __init__(self, linear: Any, lib: ctypes.CDLL) -> None:
        super().__init__()
        qs = linear.weight.quant_state
        self.out_features, self.in_features = (int(d) for d in qs.shape)
        self.blocksize, self.quant_type, self.lib = int(qs.blocksize), str(qs.quant_type), lib
        codes = linear.weight.data.view(torch.uint8).reshape(self.out_features, -1)
        self.register_buffer("codes", codes.contiguous(), persistent=False)
        self.register_buffer("absmax", block_scales(qs), persistent=False)
        self.register_buffer("lut", lookup_table(self.quant_type), persistent=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), False)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.quant_type}/{self.blocksize}"

    def weight_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows `start` .. `stop` of the dequantized float32 weight."""
        out = torch.empty(stop - start, self.in_features)
        self.lib.fourbit_dequantize(
            self.codes.data_ptr(),
            self.absmax.data_ptr(),
            self.lut.data_ptr(),
            self.blocksize,
            self.in_features,
            start,
            stop,
            out.data_ptr(),
        )
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()  # bitsandbytes: compute dtype
        rows = flat.shape[0]
        if rows >= DEQUANTIZE_ROWS:
            y = dequantized_linear(flat, self.weight_rows, self.out_features)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = torch.empty(rows, self.out_features)
            bias = None if self.bias is None else self.bias.data_ptr()
            if rows and self.lib.fourbit_linear(
                flat.data_ptr(),
                rows,
                self.in_features,
                self.codes.data_ptr(),
                self.absmax.data_ptr(),
                self.lut.data_ptr(),
                self.blocksize,
                self.out_features,
                bias,
                y.data_ptr(),
            ):
                raise MemoryError("fourbit_linear: no memory for a tile of decoded weights")
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def replace_4bit_linears(model: nn.Module) -> int:
    """Replace every bitsandbytes `Linear4bit` of a CPU model that `why_kept` allows by a
    `FourBitLinear` over the same codes; returns how many were replaced (0 without bitsandbytes
    or a C compiler)."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return 0
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, Linear4bit) and why_kept(m) is None
    ]
    lib = load_kernel() if targets else None
    if lib is None:
        return 0
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, FourBitLinear(module, lib))
    return len(targets)

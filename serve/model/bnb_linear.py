"""bitsandbytes' quantized linear layers (nf4 / fp4, LLM.int8) through the engine's CPU kernels.

Model: on a CPU, bitsandbytes (0.50) runs a `Linear4bit` by dequantizing its whole weight to
float32 on every call and then `F.linear` (where it has no AVX512-BF16 kernel), and a
`Linear8bitLt` by casting its whole int8 weight to float32 for a float32 matmul of the int8
codes (where it has no AVX-512): SmolLM2-135M takes 166 ms (nf4) and 124-150 ms (int8) a decode
step of one sequence against the float32 model's 44. The replacements keep the same codes and
scales and run `kernels/bnb_linear.c`, which decodes a tile of weight rows at a time in cache:
- `FourBitLinear`: the weights bitsandbytes dequantizes, bit for bit, multiplied in float32:
  its products up to the order of the sums.
- `Int8Linear`: LLM.int8 as bitsandbytes' torch ops compute it, step for step in their roundings
  (the input rounded to float16 and quantized per row, outlier columns listed, the dequantization),
  in the kernel; the int8 product in float32 is exact integers below 2^24, so the same int32
  bitsandbytes computes; the outlier columns' float product stays bitsandbytes' `addmm`.
Calls of `DEQUANTIZE_ROWS` rows or more (prefill chunks, evaluation batches) decode a bounded
slice of rows at a time and multiply through `F.linear`, which is faster there; LLM.int8's
product goes through torch's int8 matmul (`torch._int_mm`: bitsandbytes' int32 sums, exactly)
where it is exact here (`exact_int8_products`), 2.2-4x the float32 product's speed.
A layer stays bitsandbytes' where bitsandbytes computes differently (its AVX512-BF16 4-bit kernel
multiplies in bfloat16; a compute dtype other than float32; float16 int8 weights) or where the
kernel's contract does not hold (in_features and the block size multiples of 8);
`why_kept_4bit` / `why_kept_int8` say which. Double-quantized 4-bit block scales are dequantized once, as bitsandbytes does on
every call: 4 bytes a block of 64 weights in memory instead of about 1.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import torch
from torch import nn

from compress.packed import dequantized_linear
from serve.model.native import KERNELS, ROUNDED_AS_WRITTEN, load_library

SOURCE = KERNELS / "bnb_linear.c"
COMPILE = ROUNDED_AS_WRITTEN
"""Each 4-bit weight is bitsandbytes' float32 product of its code's value and scale, and
LLM.int8's steps round as its torch ops do."""
DEQUANTIZE_ROWS = 128
"""Rows from which a call dequantizes slices of the weight and runs `F.linear`. Measured on a
2-core AVX2 CPU at SmolLM2's shapes (576 -> 3,072, 1,536 -> 576): the kernel takes 0.6-0.8x
that path's time at 16 rows, about the same at 64, 1.1-1.8x at 128 and 1.25x at 512-1,024;
bitsandbytes' own call takes 1.5-3x the kernel's time at 1-16 rows."""


@cache
def load_kernel() -> ctypes.CDLL | None:
    """The kernels' library, built on first use; None (and one log line) where it cannot be."""
    p, i = ctypes.c_void_p, ctypes.c_int64
    signatures = {
        "fourbit_linear": [p, i, i, p, p, p, i, i, p, p],
        "fourbit_dequantize": [p, p, p, i, i, i, i, p],
        "llm_int8_linear": [p, i, i, p, p, i, p, ctypes.c_float, p, p, p],
        "llm_int8_quantize": [p, i, i, ctypes.c_float, p, p, p, p],
        "llm_int8_dequantize": [p, i, i, p, p, p],
    }
    return load_library(SOURCE, COMPILE, signatures, "bitsandbytes' own layers kept")


@cache
def exact_int8_products() -> bool:
    """Whether `torch._int_mm` runs fast and exact here: torch sends it to oneDNN only on CPUs
    with VNNI (elsewhere a scalar reference loop, slower than float32: bitsandbytes keys on the
    same), and oneDNN's int8 products without VNNI sum pairs of u8 x s8 products in saturating
    int16 (measured: wrong sums under `ONEDNN_MAX_CPU_ISA=AVX2` on a VNNI CPU), so a probe of
    extreme and random codes must come out exact too."""
    if not getattr(torch.cpu, "_is_vnni_supported", lambda: False)():
        return False
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=generator)
    b = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=generator)
    a[:8], b[:8], b[8:16] = 127, 127, -127
    try:
        product = torch._int_mm(a, b.t())
    except RuntimeError:
        return False
    return bool(torch.equal(product.long(), a.long() @ b.long().t()))


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


def why_kept_4bit(module: Any) -> str | None:
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
    """A bitsandbytes 4-bit linear (float32 compute) through `kernels/bnb_linear.c`."""

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


def why_kept_int8(module: Any) -> str | None:
    """Why a bitsandbytes `Linear8bitLt` stays bitsandbytes' own, or None when it can be replaced."""
    codes = int8_codes(module)
    if codes is None or module.state.has_fp16_weights:
        return "it holds float16 weights (quantized at its first call)"
    if codes.device.type != "cpu":
        return "it is not on the CPU"
    if codes.shape[1] % 8:
        return f"in_features {codes.shape[1]} must be a multiple of 8"
    return None


def int8_codes(module: Any) -> torch.Tensor | None:
    """A `Linear8bitLt`'s int8 weight, before or after its first call moved it into its state."""
    for codes in (module.state.CB, getattr(module.weight, "CB", None), module.weight.data):
        if codes is not None and codes.dtype == torch.int8:
            return codes
    return None


class Int8Linear(nn.Module):
    """A bitsandbytes LLM.int8 linear (int8 weights) with its int8 product through the kernel."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, linear: Any, lib: ctypes.CDLL) -> None:
        super().__init__()
        codes = int8_codes(linear)
        assert codes is not None  # why_kept_int8
        scales = linear.state.SCB if linear.state.SCB is not None else linear.weight.SCB
        self.out_features, self.in_features = codes.shape
        self.threshold, self.lib = float(linear.state.threshold), lib
        self.half_threshold = float(torch.tensor(self.threshold).half())
        """bitsandbytes compares float16 inputs with the threshold in float16."""
        self.register_buffer("codes", codes.contiguous(), persistent=False)
        self.register_buffer("scales", scales.float().contiguous(), persistent=False)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), False)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, int8, threshold {self.threshold}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """bitsandbytes' `MatMul8bitLt.forward` at inference: the kernel's quantization and
        dequantization around torch's int8 product where it is exact (faster at every row count:
        1.1x the kernel's speed at one row, 2.6x at 127); elsewhere below `DEQUANTIZE_ROWS` rows
        one kernel call (`llm_int8_linear`), from there a dequantizing product."""
        a = x.reshape(-1, self.in_features).float().contiguous()
        if a.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if a.shape[0] < DEQUANTIZE_ROWS and not exact_int8_products():
            y, outlier_cols = self._kernel_call(a, self.bias)
        else:
            y, outlier_cols = self._dequantizing_product(a, self.bias)
        if self.threshold > 0 and outlier_cols.numel():
            import bitsandbytes.functional as bnb_functional

            columns = self.codes[:, outlier_cols].contiguous()
            weight = bnb_functional.int8_vectorwise_dequant(columns, self.scales)
            y = y.addmm(a[:, outlier_cols].contiguous(), weight.float().t())
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _kernel_call(
        self, a: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.empty(a.shape[0], self.out_features)
        cols = torch.empty(self.in_features, dtype=torch.int64)
        count = ctypes.c_int64(0)
        if self.lib.llm_int8_linear(
            a.data_ptr(),
            a.shape[0],
            self.in_features,
            self.codes.data_ptr(),
            self.scales.data_ptr(),
            self.out_features,
            None if bias is None else bias.data_ptr(),
            self.half_threshold,
            y.data_ptr(),
            cols.data_ptr(),
            ctypes.byref(count),
        ):
            raise MemoryError("llm_int8_linear: no memory for its buffers")
        return y, cols[: count.value]

    def _dequantizing_product(
        self, a: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = a.shape[0]
        codes, row_scales = torch.empty_like(a), torch.empty(rows)
        cols = torch.empty(self.in_features, dtype=torch.int64)
        count = ctypes.c_int64(0)
        if self.lib.llm_int8_quantize(
            a.data_ptr(),
            rows,
            self.in_features,
            self.half_threshold,
            codes.data_ptr(),
            row_scales.data_ptr(),
            cols.data_ptr(),
            ctypes.byref(count),
        ):
            raise MemoryError("llm_int8_quantize: no memory for its buffers")
        weight = self.codes
        if exact_int8_products():
            y = torch._int_mm(codes.to(torch.int8), weight.t()).float()
        else:  # float32 sums of integer products: exact below 2^24
            y = dequantized_linear(codes, lambda i, j: weight[i:j].float(), self.out_features)
            y = y.contiguous()
        self.lib.llm_int8_dequantize(
            y.data_ptr(),
            rows,
            self.out_features,
            row_scales.data_ptr(),
            self.scales.data_ptr(),
            None if bias is None else bias.data_ptr(),
        )
        return y, cols[: count.value]


def replace_bnb_linears(model: nn.Module) -> int:
    """Replace every bitsandbytes `Linear4bit` / `Linear8bitLt` of a CPU model that `why_kept_4bit`
    / `why_kept_int8` allow by a `FourBitLinear` / `Int8Linear` over the same codes; returns how
    many were replaced (0 without bitsandbytes or a C compiler)."""
    try:
        from bitsandbytes.nn import Linear4bit, Linear8bitLt
    except ImportError:
        return 0
    kinds = ((Linear4bit, why_kept_4bit, FourBitLinear), (Linear8bitLt, why_kept_int8, Int8Linear))
    targets = [
        (name, m, replacement)
        for name, m in model.named_modules()
        for kind, why_kept, replacement in kinds
        if isinstance(m, kind) and why_kept(m) is None
    ]
    lib = load_kernel() if targets else None
    if lib is None:
        return 0
    for name, module, replacement in targets:
        model.set_submodule(name, replacement(module, lib))
    return len(targets)

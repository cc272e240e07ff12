"""The engine's kernels for bitsandbytes layers: nf4 / fp4 with bitsandbytes' dequantized weights
bit for bit and its products up to float32 summation order, LLM.int8 with equal results, and
only where bitsandbytes would compute the same way."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from serve.model.bnb_linear import (
    DEQUANTIZE_ROWS,
    FourBitLinear,
    Int8Linear,
    exact_int8_products,
    load_kernel,
    replace_bnb_linears,
    why_kept_4bit,
    why_kept_int8,
)

bnb = pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler for the 4-bit kernel")


def kernel() -> ctypes.CDLL:
    lib = load_kernel()
    assert lib is not None  # pytestmark
    return lib


def quantized(
    out_features: int,
    in_features: int,
    quant_type: str = "nf4",
    nested: bool = True,
    bias: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    blocksize: int = 64,
) -> Any:
    torch.manual_seed(out_features * 7 + in_features)
    layer = bnb.nn.Linear4bit(
        in_features,
        out_features,
        bias=bias,
        compute_dtype=compute_dtype,
        quant_type=quant_type,
        compress_statistics=nested,
    )
    weight = torch.randn(out_features, in_features) * 0.05
    layer.weight = bnb.nn.Params4bit(
        weight,
        requires_grad=False,
        quant_type=quant_type,
        compress_statistics=nested,
        blocksize=blocksize,
    )
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(out_features), requires_grad=False)
    layer = layer.to("cpu")  # quantizes
    layer.support_avx512bf16_for_cpu = False  # bitsandbytes' dequantize + F.linear, any CPU
    return layer


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_dequantized_rows_equal_bitsandbytes_bit_for_bit(
    quant_type: str, nested: bool, blocksize: int
) -> None:
    layer = quantized(97, 256, quant_type, nested, blocksize=blocksize)
    expected = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    mine = FourBitLinear(layer, kernel())
    assert torch.equal(mine.weight_rows(0, 97), expected)
    assert torch.equal(mine.weight_rows(40, 61), expected[40:61])


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 65, DEQUANTIZE_ROWS - 1, DEQUANTIZE_ROWS, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_products_equal_bitsandbytes_up_to_summation_order(rows: int, bias: bool) -> None:
    """Odd sizes on purpose: 97 output rows leave partial tiles and register blocks, 1-3 rows of
    x the row tail; from DEQUANTIZE_ROWS the dequantizing path."""
    layer = quantized(97, 192, bias=bias)
    mine = FourBitLinear(layer, kernel())
    x = torch.randn(rows, 192)
    with torch.no_grad():
        expected, got = layer(x), mine(x)
    assert got.shape == expected.shape == (rows, 97)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_batched_and_bfloat16_inputs_are_computed_in_float32_like_bitsandbytes() -> None:
    """bitsandbytes casts x to the compute dtype (float32) and the output back to x's dtype."""
    layer = quantized(64, 128)
    mine = FourBitLinear(layer, kernel())
    x = torch.randn(2, 3, 128)
    with torch.no_grad():
        torch.testing.assert_close(mine(x), layer(x), rtol=1e-5, atol=1e-5)
        xb = x.to(torch.bfloat16)
        got, expected = mine(xb), layer(xb)
    assert got.dtype == expected.dtype == torch.bfloat16
    scale = expected.float().abs().max().item()  # the float32 results, rounded to bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-8, atol=2**-8 * scale)
    assert mine(torch.empty(0, 128)).shape == (0, 64)


def test_only_layers_bitsandbytes_computes_in_float32_by_dequantizing_are_replaced() -> None:
    kept_avx512: Any = quantized(64, 128)
    kept_avx512.support_avx512bf16_for_cpu = True
    layers = torch.nn.ModuleDict(
        {
            "plain": quantized(64, 128),
            "bf16": quantized(64, 128, compute_dtype=torch.bfloat16),
            "avx512": kept_avx512,
            "unquantized": torch.nn.Linear(128, 64),
        }
    )
    assert "bfloat16" in str(why_kept_4bit(layers["bf16"]))
    assert "AVX512-BF16" in str(why_kept_4bit(layers["avx512"]))
    assert why_kept_4bit(layers["plain"]) is None
    assert replace_bnb_linears(layers) == 1
    assert isinstance(layers["plain"], FourBitLinear)
    assert isinstance(layers["bf16"], bnb.nn.Linear4bit)
    assert isinstance(layers["avx512"], bnb.nn.Linear4bit)
    assert type(layers["unquantized"]) is torch.nn.Linear


def int8_layer(out_features: int, in_features: int, threshold: float, bias: bool) -> Any:
    torch.manual_seed(out_features + in_features)
    layer = bnb.nn.Linear8bitLt(
        in_features, out_features, bias=bias, has_fp16_weights=False, threshold=threshold
    )
    weight = torch.randn(out_features, in_features) * 0.05
    layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(out_features), requires_grad=False)
    return layer.to("cpu").eval()  # quantizes; eval: the inference path (MatMul8bitLt)


@pytest.fixture(params=["kernel", "int_mm"])
def int8_product(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each LLM.int8 test through both products: the C kernel and float32 sums (what CPUs
    without exact int8 products run), and torch's int8 matmul (where this CPU's is exact)."""
    if request.param == "int_mm" and not exact_int8_products():
        pytest.skip("torch._int_mm is not exact on this CPU (no VNNI): the engine keeps the kernel")
    exact = request.param == "int_mm"
    monkeypatch.setattr("serve.model.bnb_linear.exact_int8_products", lambda: exact)
    return str(request.param)


def int8_input(rows: int, in_features: int, outliers: bool) -> torch.Tensor:
    x = torch.randn(rows, in_features)
    if outliers:  # LLM.int8's outlier features: a few columns far above the threshold
        x[:, [3, 50, 51]] *= 20.0
    return x


@pytest.mark.parametrize("rows", [1, 3, 4, 17, DEQUANTIZE_ROWS - 1, DEQUANTIZE_ROWS, 300])
@pytest.mark.parametrize(
    ("threshold", "outliers", "bias"),
    [(6.0, True, True), (6.0, False, False), (0.0, True, False)],
)
def test_int8_products_equal_bitsandbytes_bit_for_bit(
    rows: int, threshold: float, outliers: bool, bias: bool, int8_product: str
) -> None:
    """The same quantization, int32 product (exact), dequantization and outlier product as
    bitsandbytes' own layer: equal results, not merely close."""
    layer = int8_layer(97, 192, threshold, bias)
    x = int8_input(rows, 192, outliers)
    with torch.no_grad():
        expected = layer(x.clone())
        mine = Int8Linear(layer, kernel())  # after the call: its weight moved into its state
        got = mine(x)
    assert got.shape == expected.shape == (rows, 97)
    assert torch.equal(got, expected)
    if outliers and threshold:
        assert (x.abs() >= threshold).any()  # the outlier path ran


def test_int8_layers_replace_before_or_after_their_first_call_and_keep_fp16_ones(
    int8_product: str,
) -> None:
    fresh, called = int8_layer(64, 128, 6.0, False), int8_layer(64, 128, 6.0, False)
    x = int8_input(5, 128, True)
    with torch.no_grad():
        expected = called(x.clone())
    trainable = bnb.nn.Linear8bitLt(128, 64, has_fp16_weights=True)
    assert "float16" in str(why_kept_int8(trainable))
    layers = torch.nn.ModuleDict({"fresh": fresh, "called": called, "trainable": trainable})
    assert replace_bnb_linears(layers) == 2
    assert isinstance(layers["fresh"], Int8Linear) and isinstance(layers["called"], Int8Linear)
    with torch.no_grad():
        assert torch.equal(layers["fresh"](x), expected)
        assert torch.equal(layers["called"](x), expected)
    assert isinstance(layers["trainable"], bnb.nn.Linear8bitLt)


def test_int8_kernel_rounds_every_step_as_bitsandbytes_over_many_inputs(int8_product: str) -> None:
    """The kernel does bitsandbytes' float16 cast, outlier split, row scales (torch's 127 / s is
    s.reciprocal() * 127), half-to-even rounding and dequantization: 40 random batches of 1 to
    400 rows (both paths; from 256 rows its quantization runs on every thread), scales from tiny
    to outlier-heavy, a zero row, all equal to bitsandbytes' results."""
    layer = int8_layer(67, 256, 6.0, True)
    mine = Int8Linear(layer, kernel())
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        rows = 1 + trial * 37 % 400
        x = torch.randn(rows, 256, generator=gen) * float(10 ** (trial % 5 - 2))
        x[rows // 2] = 0.0
        with torch.no_grad():
            assert torch.equal(mine(x), layer(x.clone())), f"trial {trial}: {rows} rows"


SATURATING_PRODUCTS = """
import sys
import torch
import bitsandbytes as bnb
from serve.model.bnb_linear import Int8Linear, exact_int8_products, load_kernel
layer = torch.load(sys.argv[1], weights_only=False)
x = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(Int8Linear(layer, load_kernel())(x), sys.argv[3])
print(exact_int8_products())
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN's x86 ISAs")
def test_int8_products_stay_exact_where_onednn_int8_matmul_saturates(tmp_path: Path) -> None:
    """oneDNN's int8 matmul without VNNI sums u8 x s8 pairs in saturating int16: codes at their
    extremes (every pair 2 x 255 x 127) give wrong int32 sums. Forced here on any x86 CPU
    (`ONEDNN_MAX_CPU_ISA=AVX2`, while torch still believes VNNI runs): the probe must see it and
    the layer keep exact results (bitsandbytes' own, computed outside that setting)."""
    layer = bnb.nn.Linear8bitLt(256, 64, bias=False, has_fp16_weights=False, threshold=6.0)
    weight = torch.full((64, 256), 0.05)
    weight[32:] = -0.05
    layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    layer = layer.to("cpu").eval()
    x = torch.full((200, 256), 5.0)
    x[100:] = -5.0
    torch.save(layer, tmp_path / "layer.pt")
    torch.save(x, tmp_path / "x.pt")
    with torch.no_grad():
        expected = layer(x.clone())
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    paths = [str(tmp_path / name) for name in ("layer.pt", "x.pt", "y.pt")]
    done = subprocess.run(
        [sys.executable, "-c", SATURATING_PRODUCTS, *paths], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"
    assert torch.equal(torch.load(paths[2]), expected)

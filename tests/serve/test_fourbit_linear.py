"""The engine's 4-bit kernel for bitsandbytes nf4 / fp4 layers: bitsandbytes' dequantized weights
bit for bit, its products up to float32 summation order, and only where bitsandbytes would
compute the same way."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch

from serve.model.fourbit_linear import (
    DEQUANTIZE_ROWS,
    FourBitLinear,
    load_kernel,
    replace_4bit_linears,
    why_kept,
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
    assert "bfloat16" in str(why_kept(layers["bf16"]))
    assert "AVX512-BF16" in str(why_kept(layers["avx512"]))
    assert why_kept(layers["plain"]) is None
    assert replace_4bit_linears(layers) == 1
    assert isinstance(layers["plain"], FourBitLinear)
    assert isinstance(layers["bf16"], bnb.nn.Linear4bit)
    assert isinstance(layers["avx512"], bnb.nn.Linear4bit)
    assert type(layers["unquantized"]) is torch.nn.Linear

"""Packed weights and the modules that serve them: each equals a matmul with the dequantized
weight `(q - z) * s`, through torch's int4 / int8 CPU kernels, which compute in bfloat16 (so to
bfloat16's precision: 8 bits of mantissa)."""

from __future__ import annotations

import pytest
import torch

from compress.grids import hqq, rtn
from compress.packed import (
    PackedEmbedding8,
    PackedFormat,
    PackedLinear4,
    PackedLinear8,
    pack_codes,
    unpack_codes,
)


@pytest.fixture
def weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(48, 256)


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("quantize", [rtn, hqq], ids=["rtn", "hqq"])
def test_int4_module_equals_the_dequantized_matmul(
    weight: torch.Tensor, group: int, quantize
) -> None:
    qw = quantize(weight, PackedFormat(4, group))
    bias = torch.randn(48)
    module = PackedLinear4(qw, bias, torch.float32)
    assert module.kernel and module.packed.dtype == torch.uint8
    x = torch.randn(2, 7, 256)
    y = module(x)
    assert y.dtype == torch.float32  # the model's dtype in and out
    torch.testing.assert_close(y, x @ qw.dequantize().t() + bias, rtol=2e-2, atol=0.25)


@pytest.mark.parametrize("sym", [True, False])
def test_int8_module_equals_the_dequantized_matmul(weight: torch.Tensor, sym: bool) -> None:
    qw = rtn(weight, PackedFormat(8, None), sym=sym)
    module = PackedLinear8(qw, None, torch.float32)
    assert (module.offset is None) == sym  # a symmetric grid needs no zero-point correction
    x = torch.randn(5, 256)
    torch.testing.assert_close(module(x), x @ qw.dequantize().t(), rtol=2e-2, atol=0.25)


def test_the_kernels_compute_in_bfloat16_whatever_the_model_dtype(weight: torch.Tensor) -> None:
    """float32 and bfloat16 models give the same products: both run the bfloat16 kernels."""
    x = torch.randn(3, 256)
    for cls, fmt in ((PackedLinear4, PackedFormat(4, 64)), (PackedLinear8, PackedFormat(8, None))):
        qw = rtn(weight, fmt)
        y16 = cls(qw, None, torch.bfloat16)(x.bfloat16())
        y32 = cls(qw, None, torch.float32)(x)
        assert y16.dtype == torch.bfloat16 and y32.dtype == torch.float32
        torch.testing.assert_close(y32, y16.float(), rtol=0, atol=0)


def test_int8_embedding_reads_rows_and_keeps_the_embed_scale(weight: torch.Tensor) -> None:
    qw = rtn(weight, PackedFormat(8, None))
    embedding = PackedEmbedding8(qw, torch.float32, torch.tensor(3.0))
    ids = torch.tensor([[0, 47, 5], [5, 5, 1]])
    torch.testing.assert_close(embedding(ids), qw.dequantize()[ids] * 3.0)


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_round_trip_through_storage(bits: int) -> None:
    q = torch.randint(0, 2**bits, (16, 64), dtype=torch.uint8)
    stored = pack_codes(q, bits)
    assert stored.shape[1] == (32 if bits == 4 else 64)
    assert torch.equal(unpack_codes(stored, bits), q)


def test_format_names() -> None:
    assert PackedFormat.parse("int4-g128") == PackedFormat(4, 128)
    assert PackedFormat.parse("int8").bits_per_weight() == 8.0
    assert PackedFormat(4, 32).bits_per_weight() == 6.0  # two float32 per 32 weights
    with pytest.raises(ValueError, match="unknown packed format 'int4-g48'"):
        PackedFormat.parse("int4-g48")


def test_hqq_equals_the_reference_library(weight: torch.Tensor) -> None:
    """The `hqq` library's own quantize/dequantize of the same weight, value for value."""
    from hqq.core.quantize import Quantizer

    for fmt in (PackedFormat(4, 64), PackedFormat(8, None)):
        q, meta = Quantizer.quantize(
            weight,
            nbits=fmt.bits,
            group_size=fmt.group_size or 256,
            optimize=True,
            round_zero=False,
            axis=1,
            compute_dtype=torch.float32,
            device="cpu",
            bitpack=False,
        )
        reference = Quantizer.dequantize(q, meta).reshape(weight.shape)
        torch.testing.assert_close(hqq(weight, fmt).dequantize(), reference, rtol=0, atol=1e-6)
        assert float((reference - weight).abs().mean()) < float(
            (rtn(weight, fmt).dequantize() - weight).abs().mean()
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_modules_on_cuda_dequantize_per_call(weight: torch.Tensor) -> None:
    """Off the CPU the packed layers dequantize in the model's dtype (correct, not fast)."""
    x = torch.randn(4, 256)
    for cls, fmt in ((PackedLinear4, PackedFormat(4, 64)), (PackedLinear8, PackedFormat(8, None))):
        qw = rtn(weight, fmt)
        on_gpu = type(qw)(qw.q.cuda(), qw.scales.cuda(), qw.zeros.cuda())
        module = cls(on_gpu, None, torch.float32)
        assert not module.kernel
        torch.testing.assert_close(
            module(x.cuda()).cpu(), x @ qw.dequantize().t(), rtol=1e-4, atol=1e-3
        )

"""Packed weights and the modules that serve them: each equals a matmul with the dequantized
weight `(q - z) * s`, through torch's int4 / int8 CPU kernels, which compute in bfloat16 (so to
bfloat16's precision: 8 bits of mantissa)."""

from __future__ import annotations

import pytest
import torch

from compress.grids import hqq, rtn
from compress.int4pack import CANDIDATES, Layout, find_layout
from compress.packed import (
    NATIVE_BF16_DEQUANTIZE_ROWS,
    PackedFormat,
    PackedLinear4,
    PackedLinear8,
    PackedLinear8Grouped,
    dequantize_rows,
    pack_codes,
    unpack_codes,
)
from compress.packed_modules import PackedEmbedding4, PackedEmbedding8, packed_embedding


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


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [32, 128])
def test_grouped_int8_module_is_the_dequantized_matmul_in_float32(
    weight: torch.Tensor, group: int, sym: bool
) -> None:
    """No kernel runs int8 in groups: the weight is dequantized per call in the activations'
    dtype, so a float32 model gets float32 products (no bfloat16 rounding)."""
    qw = rtn(weight, PackedFormat(8, group), sym=sym)
    bias = torch.randn(48)
    module = PackedLinear8Grouped(qw, bias, torch.float32)
    assert module.groups == 256 // group
    assert (module.offset is None) == sym
    assert module.q_signed.dtype == torch.int8  # one byte a weight at rest
    x = torch.randn(2, 7, 256)
    torch.testing.assert_close(module(x), x @ qw.dequantize().t() + bias, rtol=1e-5, atol=1e-5)


def test_grouped_int8_dequantizes_a_bounded_slice_at_a_time(
    weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 262k-row tied head would need its whole float weight at once; slices of rows give
    the same products."""
    qw = rtn(weight, PackedFormat(8, 32))
    module = PackedLinear8Grouped(qw, None, torch.float32)
    x = torch.randn(3, 256)
    whole = module(x)
    monkeypatch.setattr("compress.packed.DEQUANTIZE_CHUNK", 256 * 5)  # 5 rows, 10 slices
    sliced: list[int] = []
    rows = module.weight_rows
    module.weight_rows = lambda a, b, dtype: sliced.append(a) or rows(a, b, dtype)  # type: ignore[method-assign]
    torch.testing.assert_close(module(x), whole, rtol=1e-5, atol=1e-5)  # summed in other blocks
    assert sliced == list(range(0, 48, 5))


def test_the_kernels_compute_in_bfloat16_whatever_the_model_dtype(weight: torch.Tensor) -> None:
    """float32 and bfloat16 models give the same products: both run the bfloat16 kernels."""
    x = torch.randn(3, 256)
    for cls, fmt in ((PackedLinear4, PackedFormat(4, 64)), (PackedLinear8, PackedFormat(8, None))):
        qw = rtn(weight, fmt)
        y16 = cls(qw, None, torch.bfloat16)(x.bfloat16())
        y32 = cls(qw, None, torch.float32)(x)
        assert y16.dtype == torch.bfloat16 and y32.dtype == torch.float32
        torch.testing.assert_close(y32, y16.float(), rtol=0, atol=0)


def _kernel_rows(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module on `x` a few rows per call: the kernels' own products."""
    return torch.cat([module(part) for part in x.split(8)])


def _bfloat16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart two tensors of bfloat16 values are."""
    step = torch.maximum(a.abs(), b.abs()).clamp(min=1e-30).log2().floor().exp2() / 128
    return ((a - b).abs() / step).round()


@pytest.mark.parametrize(
    "fmt", [PackedFormat(4, 32), PackedFormat(4, 128), PackedFormat(8, None)], ids=str
)
@pytest.mark.parametrize("sym", [True, False])
def test_a_prefill_sized_call_dequantizes_and_gives_the_kernels_numbers(
    fmt: PackedFormat, sym: bool
) -> None:
    """From `dequantize_rows` rows a call is a float32 matmul of the dequantized weight, with the
    kernels' bfloat16 scales and their rounding of activations and output: the kernels' products
    up to float32 summation order, so nearly every output is the same bfloat16 value and none is
    more than two bfloat16 steps away (one on AVX2)."""
    torch.manual_seed(2)
    weight = torch.randn(208, 256)  # 208 rows: six full int4 blocks of 32 and a short one
    qw = rtn(weight, fmt, sym=sym)
    cls = PackedLinear4 if fmt.bits == 4 else PackedLinear8
    module = cls(qw, None, torch.float32)
    x = torch.randn(dequantize_rows(fmt.bits, torch.zeros(1)) + 5, 256)
    calls: list[int] = []
    rows = module.weight_rows
    module.weight_rows = lambda a, b: calls.append(a) or rows(a, b)  # type: ignore[method-assign]
    y = module(x)
    assert calls == [0]  # dequantized once, whole (208 x 256 weights: one slice)
    kernel = _kernel_rows(module, x)
    assert calls == [0]  # 8-row calls ran the kernel
    ulps = _bfloat16_ulps(y, kernel)
    # one bfloat16 step on AVX2 (the kernels emulate bf16 there); with native avx512_bf16 the
    # int8 kernel sums in another order, and outputs near zero of an asymmetric grid (its
    # zero-point correction cancels) land further: 1 of 14,352 two steps away at 69 rows; at
    # 1,029 rows (native bfloat16's threshold) 1 of 214,032 is 20 / 64 steps from a value near 0
    assert float((ulps == 0).float().mean()) > 0.99 and float((ulps <= 2).float().mean()) > 0.999
    assert float((y - kernel).abs().max()) <= 2**-8 * float(kernel.abs().max())
    torch.testing.assert_close(y, x @ qw.dequantize().t(), rtol=2e-2, atol=0.25)
    bias = torch.randn(208)
    module.bias = torch.nn.Parameter(bias, requires_grad=False)
    assert torch.equal(module(x), y + bias)


@pytest.mark.parametrize("fmt", [PackedFormat(4, 32), PackedFormat(8, None)], ids=str)
@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "emulated-bf16"])
def test_a_bfloat16_model_multiplies_prefill_sized_calls_in_bfloat16_where_that_is_native(
    fmt: PackedFormat, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 model on a CPU with native bfloat16 products multiplies its prefill-sized
    calls in bfloat16 (int8 codes exactly, int4 weights rounded to bfloat16): within a few
    bfloat16 steps of the float32 product, most outputs equal. Where bfloat16 is emulated, and
    for a float32 model anywhere, the product stays float32 and both models agree exactly."""
    monkeypatch.setattr("compress.packed._native_bf16", lambda: native)
    torch.manual_seed(2)
    qw = rtn(torch.randn(208, 256), fmt, sym=False)
    cls = PackedLinear4 if fmt.bits == 4 else PackedLinear8
    model16, model32 = cls(qw, None, torch.bfloat16), cls(qw, None, torch.float32)
    rows = [
        dequantize_rows(fmt.bits, torch.zeros(1, dtype=d)) for d in (torch.bfloat16, torch.float32)
    ]
    x = torch.randn(max(rows) + 5, 256)
    products: list[torch.dtype] = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(
        "torch.nn.functional.linear", lambda a, w: products.append(w.dtype) or linear(a, w)
    )
    y16, y32 = model16(x.bfloat16()), model32(x)
    assert products == [torch.bfloat16 if native else torch.float32, torch.float32]
    assert y16.dtype == torch.bfloat16
    if not native:
        assert torch.equal(y16.float(), y32)
        return
    # measured: 61% (int4) / 77% (int8) equal, 93% / 99% within two steps; the largest gaps
    # are outputs near zero (an asymmetric grid's zero-point correction cancels), 2^-8 / 2^-7 of
    # the largest output
    ulps = _bfloat16_ulps(y16.float(), y32)
    assert float((ulps == 0).float().mean()) > 0.5 and float((ulps <= 2).float().mean()) > 0.9
    torch.testing.assert_close(y16.float(), y32, rtol=0, atol=2**-6 * float(y32.abs().max()))


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "emulated-bf16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_calls_dequantize_from_the_rows_measured_for_this_kind_of_cpu(
    native: bool, bits: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where bfloat16 is emulated the kernels are slow from 64 rows; where it is native they are
    fast, and each kind switches where it measured slower (int4 in bfloat16 from 256 rows,
    int8 from 64, float32 products from 1,024): one row below, the kernel; at it, dequantized."""
    monkeypatch.setattr("compress.packed._native_bf16", lambda: native)
    fmt = PackedFormat(bits, 32 if bits == 4 else None)
    cls = PackedLinear4 if bits == 4 else PackedLinear8
    module = cls(rtn(torch.randn(64, 256), fmt), None, dtype)
    expected = NATIVE_BF16_DEQUANTIZE_ROWS[bits, dtype == torch.bfloat16] if native else 64
    assert dequantize_rows(bits, torch.zeros(1, dtype=dtype)) == expected
    dequantized: list[int] = []
    rows = module.weight_rows
    module.weight_rows = lambda *a: dequantized.append(1) or rows(*a)  # type: ignore[method-assign]
    products: list[int] = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(
        "torch.nn.functional.linear", lambda a, w: products.append(1) or linear(a, w)
    )
    module(torch.randn(expected - 1, 256, dtype=dtype))
    assert products == []  # the kernel
    module(torch.randn(expected, 256, dtype=dtype))
    assert products == [1]


@pytest.mark.parametrize("readable_layout", [True, False], ids=["kernel-codes", "own-copy"])
def test_int4_dequantizes_whole_blocks_a_bounded_slice_at_a_time(
    readable_layout: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 262k-row tied head is dequantized in slices of whole kernel blocks (or of any rows
    when the codes are the module's own copy): the same products as in one slice."""
    if not readable_layout:
        monkeypatch.setattr("compress.packed.find_layout", lambda: None)
    torch.manual_seed(3)
    qw = rtn(torch.randn(208, 256), PackedFormat(4, 64))
    module = PackedLinear4(qw, None, torch.float32)
    x = torch.randn(dequantize_rows(4, torch.zeros(1)), 256)
    whole = module(x)
    monkeypatch.setattr("compress.packed.DEQUANTIZE_CHUNK", 256 * 70)  # 70 rows a slice
    calls: list[tuple[int, int]] = []
    rows = module.weight_rows
    module.weight_rows = lambda a, b: calls.append((a, b)) or rows(a, b)  # type: ignore[method-assign]
    torch.testing.assert_close(module(x), whole, rtol=0, atol=0)
    block = module.layout.block_n if readable_layout else 1
    step = 70 // block * block
    assert calls == [(a, min(a + step, 208)) for a in range(0, 208, step)]


def test_an_embedding_in_int8_groups_is_refused(weight: torch.Tensor) -> None:
    """Its lookup reads one scale per row: a stored manifest naming int8 groups is refused."""
    qw = rtn(weight, PackedFormat(8, 32))
    with pytest.raises(ValueError, match="not int8-g32"):
        packed_embedding(PackedFormat(8, 32), qw, torch.float32, None)


def test_int8_embedding_reads_rows_and_keeps_the_embed_scale(weight: torch.Tensor) -> None:
    qw = rtn(weight, PackedFormat(8, None))
    embedding = PackedEmbedding8(qw, torch.float32, torch.tensor(3.0))
    ids = torch.tensor([[0, 47, 5], [5, 5, 1]])
    torch.testing.assert_close(embedding(ids), qw.dequantize()[ids] * 3.0)


def _pack_as(layout: Layout, codes: torch.Tensor) -> torch.Tensor:
    """torch's weight_to_int4pack_kernel, written out for each CPU build it has: blocks of
    `block_n` rows; a full block pairs row d with d + 16 (AVX2) or lanes 0|2, 1|3 (AVX-512);
    short blocks and scalar builds pair neighbours."""
    n, k = codes.shape
    out = torch.zeros(n * k // 2, dtype=torch.uint8)
    bn = layout.block_n
    for block in range(0, n, bn):
        nb = min(bn, n - block)
        for col in range(k):
            at = block * k // 2 + col * nb // 2
            for r in range(nb):
                code = int(codes[block + r, col])
                if nb == bn and layout.interleaved:
                    lane, d, half = r // 16, r % 16, bn // 32
                    out[at + d + 16 * (lane % half)] |= code << (4 * (lane // half))
                else:
                    out[at + r // 2] |= code << (4 * (r % 2))
    return out.reshape(n, k // 2)


@pytest.mark.parametrize("layout", CANDIDATES, ids=str)
def test_int4pack_rows_read_back_in_every_builds_layout(layout: Layout) -> None:
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (64 * 2 + 48, 8), dtype=torch.uint8)  # a short last block
    packed = _pack_as(layout, codes)
    rows = torch.tensor([0, 15, 16, 31, 32, 47, 63, 64, 127, 128, 175, 5, 5])
    assert torch.equal(layout.codes(packed, rows, *codes.shape), codes[rows])


@pytest.mark.parametrize("layout", CANDIDATES, ids=str)
def test_int4pack_whole_blocks_unpack_in_every_builds_layout(layout: Layout) -> None:
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (64 * 2 + 48, 8), dtype=torch.uint8)  # a short last block
    packed = _pack_as(layout, codes)
    n, k = codes.shape
    assert torch.equal(layout.unpack(packed, n, k, 0, n), codes)
    bn = layout.block_n
    for start, stop in ((bn, n), (0, bn), (bn, 2 * bn), (2 * bn, n)):
        assert torch.equal(layout.unpack(packed, n, k, start, stop), codes[start:stop])


def test_this_torch_builds_int4pack_layout_is_found_and_matches_the_model() -> None:
    layout = find_layout()
    assert layout is not None
    codes = torch.randint(0, 16, (96 + 16, 64), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(packed.reshape(-1), _pack_as(layout, codes).reshape(-1))


@pytest.mark.parametrize("readable_layout", [True, False], ids=["kernel-codes", "own-copy"])
def test_int4_embedding_reads_rows_from_the_tied_heads_codes(
    weight: torch.Tensor, readable_layout: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not readable_layout:  # a torch build whose layout is unknown keeps its own codes
        monkeypatch.setattr("compress.packed.find_layout", lambda: None)
    qw = rtn(weight, PackedFormat(4, 32))
    embedding = PackedEmbedding4(qw, torch.float32, torch.tensor(3.0))
    assert hasattr(embedding.linear, "q") != readable_layout  # one copy when readable
    # rows as the head's kernel sees them: (q - 8) * s + (8 - z) * s with bfloat16 s and offsets
    s = qw.scales.bfloat16().float().repeat_interleave(32, dim=1)
    m = ((8 - qw.zeros) * qw.scales).bfloat16().float().repeat_interleave(32, dim=1)
    rows = (qw.q.float() - 8) * s + m
    ids = torch.tensor([[0, 47, 5], [5, 31, 16]])
    torch.testing.assert_close(embedding(ids), rows[ids] * 3.0)
    torch.testing.assert_close(rows, qw.dequantize(), rtol=0, atol=0.05)
    x = torch.randn(4, 256)  # the head: the same codes through the kernel
    torch.testing.assert_close(embedding.linear(x), x @ rows.t(), rtol=2e-2, atol=0.25)


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_round_trip_through_storage(bits: int) -> None:
    q = torch.randint(0, 2**bits, (16, 64), dtype=torch.uint8)
    stored = pack_codes(q, bits)
    assert stored.shape[1] == (32 if bits == 4 else 64)
    assert torch.equal(unpack_codes(stored, bits), q)


def test_format_names() -> None:
    assert PackedFormat.parse("int4-g128") == PackedFormat(4, 128)
    assert PackedFormat.parse("int8").bits_per_weight() == 8.0
    assert PackedFormat.parse("int8-g32") == PackedFormat(8, 32)
    assert PackedFormat.parse("int8-g128").bits_per_weight() == 8.5
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
    for cls, fmt in (
        (PackedLinear4, PackedFormat(4, 64)),
        (PackedLinear8, PackedFormat(8, None)),
        (PackedLinear8Grouped, PackedFormat(8, 32)),
    ):
        qw = rtn(weight, fmt)
        on_gpu = type(qw)(qw.q.cuda(), qw.scales.cuda(), qw.zeros.cuda())
        module = cls(on_gpu, None, torch.float32)
        assert cls is PackedLinear8Grouped or not module.kernel  # no kernel at all
        torch.testing.assert_close(
            module(x.cuda()).cpu(), x @ qw.dequantize().t(), rtol=1e-4, atol=1e-3
        )

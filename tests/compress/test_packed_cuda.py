"""int4 and int8 packed weights on CUDA: tinygemm's operand layout and scales written as plain
tensor code (checked on the CPU against an emulation of the kernel's reads and arithmetic), and
on a GPU the real kernels against the dequantized weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compress.grids import hqq, rtn
from compress.packed import PackedFormat, PackedLinear4, PackedLinear8, Quantized
from compress.packed_cuda import (
    TinygemmLinear4,
    inner_k_tiles,
    kernel_scales_and_zeros,
    tinygemm_layout,
    tinygemm_rows,
)
from compress.packed_modules import PackedEmbedding4, packed_module

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _codes_as_tinygemm_reads_them(packed: torch.Tensor) -> torch.Tensor:
    """The [rows, k] codes tinygemm's B loader sees (`BLayout_TC_int4::load` then the
    m16n8k16 B fragment): lane t of a row tile is column t // 4 of the tile; each of its words
    unpacks into four 32-bit registers h[0..3] (nibbles i and i + 4: the low and the high
    bfloat16), h[0], h[1] feeding k tile 2j and h[2], h[3] tile 2j + 1; register h[i] holds k
    rows 2 * (t % 4) + 8 * (i % 2) and the next one."""
    tiles, outer, lanes, half_tiles = packed.shape
    inner = 2 * half_tiles
    codes = torch.empty(tiles * 8, outer * inner * 16, dtype=torch.uint8)
    words = packed.long()
    for t in range(lanes):
        for j in range(half_tiles):
            for i in range(4):
                tile = torch.arange(outer) * inner + 2 * j + i // 2
                k = tile * 16 + 2 * (t % 4) + 8 * (i % 2)
                for half in (0, 1):  # the register's low, then high bfloat16
                    nibble = (words[:, :, t, j] >> (4 * i + 16 * half)) & 0xF
                    codes[torch.arange(tiles)[:, None] * 8 + t // 4, k[None, :] + half] = nibble.to(
                        torch.uint8
                    )
    return codes


def _tinygemm_emulated(
    x: torch.Tensor, packed: torch.Tensor, group: int, sz: torch.Tensor
) -> torch.Tensor:
    """tinygemm's product as its kernel computes it: bfloat16 x, each weight `(q - 8) * s + m`
    one bfloat16 fused multiply-add of its group's bfloat16 scale and offset, float32 sums,
    a bfloat16 output [m, padded rows]."""
    q = _codes_as_tinygemm_reads_them(packed).float() - 8
    s = sz[..., 0].t().float().repeat_interleave(group, dim=1)
    m = sz[..., 1].t().float().repeat_interleave(group, dim=1)
    w = (q * s + m).bfloat16().float()
    return (x.bfloat16().float() @ w.t()).bfloat16()


@pytest.mark.parametrize("k", [32, 64, 96, 128, 384])
def test_the_layout_is_the_codes_as_tinygemm_reads_them(k: int) -> None:
    """Every inner_k_tiles (8 where 128 divides k, 4 at 64, 2 at 32), a short last row tile."""
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (21, k), dtype=torch.uint8)
    packed = tinygemm_layout(codes)
    tiles = inner_k_tiles(k)
    assert tiles == (8 if k % 128 == 0 else 4 if k % 64 == 0 else 2)
    assert packed.dtype == torch.int32 and packed.shape == (3, k // (16 * tiles), 32, tiles // 2)
    read = _codes_as_tinygemm_reads_them(packed)
    assert torch.equal(read[:21], codes)
    assert bool((read[21:] == 8).all())  # padded rows: a zero weight whatever the scale


def test_rows_read_back_from_the_layout() -> None:
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (37, 256), dtype=torch.uint8)
    rows = torch.tensor([0, 7, 8, 36, 5, 5, 15, 16])
    assert torch.equal(tinygemm_rows(tinygemm_layout(codes), rows, 256), codes[rows])


def test_a_large_weight_is_laid_out_in_slices_of_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    codes = torch.randint(0, 16, (70, 128), dtype=torch.uint8)
    whole = tinygemm_layout(codes)
    monkeypatch.setattr("compress.packed_cuda.LAYOUT_ROWS", 16)
    assert torch.equal(tinygemm_layout(codes), whole)


def test_scales_and_zeros_turn_our_zero_points_into_tinygemms_offsets() -> None:
    """(q - z) * s == (q - 8) * s + (8 - z) * s; padded rows get zero scales and offsets."""
    scales = torch.tensor([[0.5, 0.25], [2.0, 1.0]])
    zeros = torch.tensor([[3.0, 8.0], [0.5, 15.0]])
    sz = kernel_scales_and_zeros(scales, zeros, rows=8)
    assert sz.dtype == torch.bfloat16 and sz.shape == (2, 8, 2)
    assert torch.equal(sz[..., 0].t()[:2].float(), scales)
    assert torch.equal(sz[..., 1].t()[:2].float(), torch.tensor([[2.5, 0.0], [15.0, -7.0]]))
    assert not sz[:, 2:].any()


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("quantize", [rtn, hqq], ids=["rtn", "hqq"])
def test_the_emulated_kernel_equals_the_dequantized_matmul(group: int, quantize) -> None:
    """Our conversion through tinygemm's formula: the dequantized reference to bfloat16
    rounding (activations, scales and offsets, weights and output rounded to bfloat16)."""
    torch.manual_seed(3)
    weight = torch.randn(44, 512)  # 44 rows: a padded last tile
    qw = quantize(weight, PackedFormat(4, group))
    x = torch.randn(5, 512)
    y = _tinygemm_emulated(
        x, tinygemm_layout(qw.q), group, kernel_scales_and_zeros(qw.scales, qw.zeros, 48)
    )
    reference = x @ qw.dequantize().t()
    torch.testing.assert_close(y[:, :44].float(), reference, rtol=2e-2, atol=0.25)
    assert not y[:, 44:].any()


def _as_cuda_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """`packed_module` as on a GPU that runs tinygemm, the kernel emulated on the CPU."""
    monkeypatch.setattr("compress.packed_modules.tinygemm_runs", lambda device: True)
    monkeypatch.setattr("compress.packed_cuda.int4pack_mm", _tinygemm_emulated)


def test_a_packed_int4_module_on_a_tinygemm_gpu_is_the_dequantized_matmul(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The module (rows padded and dropped, bias, the model's dtype in and out) over the
    emulated kernel."""
    _as_cuda_module(monkeypatch)
    torch.manual_seed(4)
    qw = rtn(torch.randn(44, 256), PackedFormat(4, 64))
    bias = torch.randn(44)
    module = packed_module(PackedFormat(4, 64), qw, bias, torch.float32)
    assert isinstance(module, TinygemmLinear4)
    x = torch.randn(2, 3, 256)
    y = module(x)
    assert y.shape == (2, 3, 44) and y.dtype == torch.float32
    torch.testing.assert_close(y, x @ qw.dequantize().t() + bias, rtol=2e-2, atol=0.25)


def test_an_int4_embedding_on_a_tinygemm_gpu_reads_rows_from_the_heads_operand(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One copy of the codes: the lookup reads them back from tinygemm's layout, with the
    kernel's bfloat16 scales and offsets."""
    _as_cuda_module(monkeypatch)
    torch.manual_seed(5)
    qw = rtn(torch.randn(40, 128), PackedFormat(4, 32))
    embedding = PackedEmbedding4(qw, torch.float32, None)
    assert isinstance(embedding.linear, TinygemmLinear4)
    s = qw.scales.bfloat16().float().repeat_interleave(32, dim=1)
    m = ((8 - qw.zeros) * qw.scales).bfloat16().float().repeat_interleave(32, dim=1)
    rows = (qw.q.float() - 8) * s + m
    ids = torch.tensor([[0, 39, 8], [7, 7, 16]])
    torch.testing.assert_close(embedding(ids), rows[ids])


def test_a_call_over_no_rows_launches_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose rows sample nothing calls the head on no rows; tinygemm (like any CUDA
    kernel) cannot launch an empty grid, so such a call returns an empty product."""
    _as_cuda_module(monkeypatch)

    def no_empty_launch(x: torch.Tensor, *args: torch.Tensor | int) -> torch.Tensor:
        assert x.shape[0] > 0, "a kernel launched over no rows"
        return _tinygemm_emulated(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr("compress.packed_cuda.int4pack_mm", no_empty_launch)
    module = packed_module(
        PackedFormat(4, 32), rtn(torch.randn(44, 64), PackedFormat(4, 32)), None, torch.float32
    )
    assert module(torch.randn(0, 64)).shape == (0, 44)
    assert module(torch.randn(1, 2, 64)).shape == (1, 2, 44)


def _on_cuda(qw: Quantized) -> Quantized:
    return Quantized(qw.q.cuda(), qw.scales.cuda(), qw.zeros.cuda())


@pytest.mark.gpu
@needs_cuda
def test_the_layout_equals_torchs_own_cuda_conversion() -> None:
    """Byte for byte what `_convert_weight_to_int4pack` makes of the codes (its input: two
    codes a byte, the even column in the high nibble)."""
    torch.manual_seed(6)
    for k in (128, 192, 1024):
        codes = torch.randint(0, 16, (40, k), dtype=torch.uint8).cuda()
        pairs = (codes[:, 0::2] << 4 | codes[:, 1::2]).contiguous()
        torchs = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles(k))
        assert torch.equal(tinygemm_layout(codes), torchs), k


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("quantize", [rtn, hqq], ids=["rtn", "hqq"])
def test_tinygemm_on_cuda_equals_the_emulation_and_the_dequantized_matmul(
    group: int, quantize
) -> None:
    torch.manual_seed(7)
    qw = quantize(torch.randn(264, 1024), PackedFormat(4, group))
    module = packed_module(PackedFormat(4, group), _on_cuda(qw), None, torch.bfloat16)
    assert isinstance(module, TinygemmLinear4)
    for m in (1, 16, 64, 300):
        x = torch.randn(m, 1024)
        y = module(x.cuda().bfloat16()).float().cpu()
        emulated = _tinygemm_emulated(x, module.packed.cpu(), group, module.scales_and_zeros.cpu())
        torch.testing.assert_close(y, emulated[:, :264].float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(y, x @ qw.dequantize().t(), rtol=2e-2, atol=0.5)


@pytest.mark.gpu
@needs_cuda
def test_int8_on_cuda_runs_the_kernel_for_decode_sized_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(8)
    qw = rtn(torch.randn(96, 512), PackedFormat(8, None))
    module = packed_module(PackedFormat(8, None), _on_cuda(qw), None, torch.bfloat16)
    assert isinstance(module, PackedLinear8) and module.cuda_kernel
    calls: list[int] = []
    op = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(
        "torch.ops.aten._weight_int8pack_mm", lambda *a: calls.append(a[0].shape[0]) or op(*a)
    )
    reference = None
    for m in (1, 16, 64):
        x = torch.randn(m, 512)
        reference = x @ qw.dequantize().t()
        y = module(x.cuda().bfloat16()).float().cpu()
        torch.testing.assert_close(y, reference, rtol=2e-2, atol=0.25)
    assert module(torch.zeros(0, 512, device="cuda", dtype=torch.bfloat16)).shape == (0, 96)
    assert calls == [1, 16]  # 64 rows (and none): the dequantized product
    assert reference is not None


@pytest.mark.gpu
@needs_cuda
def test_a_gpu_without_tinygemm_keeps_the_dequantized_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("compress.packed_modules.tinygemm_runs", lambda device: False)
    qw = rtn(torch.randn(48, 256), PackedFormat(4, 64))
    module = packed_module(PackedFormat(4, 64), _on_cuda(qw), None, torch.float32)
    assert isinstance(module, PackedLinear4) and not module.kernel


def _mixed_artifact(base: Path, out: Path) -> Path:
    """A packed artifact of the tiny demo model as a mixed plan writes one: attention in int4
    (groups of 32), the MLP in int8 per channel, the embedding (and its tied head) int4."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.packed_io import PackedModel, save_packed

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    modules = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            fmt = PackedFormat(4, 32) if ".self_attn." in name else PackedFormat(8, None)
            modules[name] = (fmt, rtn(module.weight.detach(), fmt))
    embedding = rtn(model.get_input_embeddings().weight.detach(), PackedFormat(4, 32))
    out.mkdir()
    save_packed(PackedModel(model, modules, (PackedFormat(4, 32), embedding)), out, {})
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def test_a_packed_artifact_loads_onto_tinygemm_and_gives_the_cpu_kernels_logits(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`load_model` of a mixed packed artifact where tinygemm runs (emulated here): every int4
    linear and the tied head become tinygemm modules reading one copy of the codes, and the
    logits are the CPU kernels' to bfloat16 rounding (measured: 0.6% of the largest logit
    at most)."""
    from compress.load_model import load_model

    path = _mixed_artifact(tiny_model_dir, tmp_path / "mixed")
    ids = torch.tensor([[5, 17, 400, 9, 300, 11, 12]])
    with torch.no_grad():
        expected = load_model(path, dtype=torch.bfloat16)(ids).logits.float()
        _as_cuda_module(monkeypatch)
        model = load_model(path, dtype=torch.bfloat16)
        got = model(ids).logits.float()
    tinygemm = [n for n, m in model.named_modules() if isinstance(m, TinygemmLinear4)]
    assert len(tinygemm) == 2 * 4 + 1 and "model.embed_tokens.linear" in tinygemm
    assert model.lm_head is model.get_input_embeddings().linear
    assert not any(isinstance(m, PackedLinear4) for m in model.modules())
    torch.testing.assert_close(got, expected, rtol=0, atol=0.02 * float(expected.abs().max()))


@pytest.mark.gpu
@needs_cuda
def test_the_engine_on_a_packed_artifact_on_cuda_equals_generate(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A mixed packed artifact on the GPU (tinygemm int4, the int8 kernel, an int4 tied head):
    the engine's greedy tokens, decode graphs replayed, equal `generate`'s on the same float32
    model (the kernels compute in bfloat16, as on the CPU, where `test_packed_methods` checks
    the same), and its logits are the CPU kernels' to bfloat16 rounding."""
    from compress.load_model import load_model
    from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
    from serve.core.sampling_params import SamplingParams
    from serve.engine.llm_engine import LLMEngine
    from tests.serve.conftest import generate_each, make_cases

    path = _mixed_artifact(tiny_model_dir, tmp_path / "mixed")
    model = load_model(path, dtype=torch.float32, device="cuda")
    assert isinstance(model.lm_head, TinygemmLinear4)
    ids = torch.tensor([[5, 17, 400, 9, 300, 11, 12]])
    with torch.no_grad():
        expected = load_model(path, dtype=torch.float32)(ids).logits.float()
        got = model(ids.cuda()).logits.float().cpu()
    torch.testing.assert_close(got, expected, rtol=0, atol=0.02 * float(expected.abs().max()))
    cases = make_cases(6, seed=3, vocab=model.config.vocab_size, max_prompt=40, max_out=12)
    reference = generate_each(model, cases)
    engine = LLMEngine(
        ModelConfig(str(path), dtype="float32", device="cuda"),
        CacheConfig(block_size=16, num_blocks=64),
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
    )
    assert engine.runner.graphs is not None
    for i, case in enumerate(cases):
        params = SamplingParams(max_tokens=case.max_tokens, temperature=0)
        engine.add_request(str(i), case.prompt, params)
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = out.token_ids
    assert [outputs[i] for i in range(len(cases))] == reference


def _int4_wo_like() -> torch.nn.Sequential:
    """Two CPU-kernel int4 linears, as int4-wo's adopted torchao weights load (208 rows: six
    full CPU blocks of 32 and a short one)."""
    torch.manual_seed(9)
    linears = [
        PackedLinear4(
            rtn(torch.randn(208, 128), PackedFormat(4, 32)), torch.randn(208), torch.float32
        ),
        PackedLinear4(rtn(torch.randn(48, 128), PackedFormat(4, 64)), None, torch.float32),
    ]
    return torch.nn.Sequential(*linears)


def test_int4_wo_linears_move_onto_tinygemm_with_their_codes_and_kernel_scales(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """int4-wo's int4 linears (CPU kernel layout) become tinygemm's over the same codes and
    bfloat16 scales and offsets: the same products to bfloat16 rounding."""
    from compress.torchao_int4 import to_tinygemm

    _as_cuda_module(monkeypatch)
    model = _int4_wo_like()
    x = torch.randn(3, 128)
    expected = [m(x) for m in model]
    codes = [m.codes() for m in model]
    assert to_tinygemm(model) == 2
    for module, want, q in zip(model, expected, codes):
        assert isinstance(module, TinygemmLinear4)
        assert torch.equal(tinygemm_rows(module.packed, torch.arange(q.shape[0]), 128), q)
        torch.testing.assert_close(module(x), want, rtol=0, atol=0.02 * float(want.abs().max()))


def test_int4_wo_stays_on_the_cpu_kernels_on_the_cpu_and_is_refused_where_no_kernel_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from compress.torchao_int4 import int4_onto

    model = _int4_wo_like()
    assert int4_onto(model, torch.device("cpu")) is model
    assert all(isinstance(m, PackedLinear4) for m in model)
    monkeypatch.setattr("compress.torchao_int4.tinygemm_runs", lambda device: False)
    with pytest.raises(ValueError, match=r"int4-wo on cuda: .* load this variant on the CPU"):
        int4_onto(model, torch.device("cuda"))


@pytest.mark.gpu
@needs_cuda
def test_int4_wo_on_cuda_runs_tinygemm_with_the_cpu_kernels_numbers() -> None:
    from compress.torchao_int4 import int4_onto

    model = _int4_wo_like()
    x = torch.randn(5, 128)
    expected = [m(x) for m in model]
    int4_onto(model, torch.device("cuda"))
    for module, want in zip(model, expected):
        assert isinstance(module, TinygemmLinear4) and module.packed.is_cuda
        got = module(x.cuda()).cpu()
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 * float(want.abs().max()))

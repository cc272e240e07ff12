"""The fused decoder layers (`serve/model/fused_layers.py`): each kernel against the
transformers module it replaces, and the engine with them against `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.model import fused_layers
from serve.model.fused_layers import FusedDecoderLayer, FusedOps, FusedRMSNorm, load_ops
from tests.serve.conftest import Case, make_cases, reference_outputs
from tests.serve.test_engine_exact import run

needs_ops = pytest.mark.skipif(
    load_ops() is None, reason="no C compiler (cc or $CC) to build the fused-op kernels"
)
DTYPES = [torch.float32, torch.bfloat16]


def ops(dtype: torch.dtype) -> FusedOps:
    lib = load_ops()
    assert lib is not None
    return FusedOps(lib, dtype)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Most units in the last place between two tensors of one float dtype."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return int((a.view(bits).int() - b.view(bits).int()).abs().max())


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_add_rms_norm_equal_llama_rms_norm(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    a, b = torch.randn(rows, 96).to(dtype), torch.randn(rows, 96).to(dtype)
    with torch.no_grad():
        got = ops(dtype).rms_norm(a, norm.weight, 1e-5)
        total, normed = ops(dtype).add_rms_norm(a, b, norm.weight, 1e-5)
    # the mean's sum is ordered differently: a few float32 ulps, one bfloat16 rounding step
    ulps = {torch.float32: 8, torch.bfloat16: 1}[dtype]
    assert ulps_apart(got, norm(a)) <= ulps
    assert torch.equal(total, a + b)
    assert ulps_apart(normed, norm(a + b)) <= ulps


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_column_slices_equals_apply_rotary_pos_emb(dtype: torch.dtype) -> None:
    """q and k as column slices of one merged projection (as `GroupedLinear` returns them),
    rotated in place: bit for bit transformers' result; v, between them, untouched."""
    torch.manual_seed(0)
    t, heads, kv_heads, d = 37, 4, 2, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d).to(dtype)
    q, k = qkv[:, : heads * d], qkv[:, heads * d : (heads + kv_heads) * d]
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    angles = torch.rand(t, d // 2) * 50
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    want_q, want_k = apply_rotary_pos_emb(
        q.view(1, t, heads, d).transpose(1, 2),
        k.view(1, t, kv_heads, d).transpose(1, 2),
        cos[None],
        sin[None],
    )
    ops(dtype).rotary(q, heads, cos, sin)
    ops(dtype).rotary(k, kv_heads, cos, sin)
    assert torch.equal(q, want_q.transpose(1, 2).reshape(t, -1))
    assert torch.equal(k, want_k.transpose(1, 2).reshape(t, -1))
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_silu_times_up_over_the_whole_range(dtype: torch.dtype) -> None:
    """Gate values from -200 to 200 (past exp's float32 range both ways) and the zeros."""
    gate_up = torch.cat([torch.linspace(-200, 200, 8001), torch.randn(8001) * 4]).to(dtype)
    gate_up = gate_up[: 2 * 8000].view(8, 2000)
    gate, up = gate_up[:, :1000], gate_up[:, 1000:]
    got = ops(dtype).silu_mul(gate, up)
    want = F.silu(gate) * up
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=1e-30)


def engine_outputs(model_dir: Path, cases: list[Case], fuse: bool) -> tuple[LLMEngine, list]:
    engine = LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cpu", fuse_layers=fuse),
        CacheConfig(block_size=16, num_blocks=512),
        SchedulerConfig(max_num_batched_tokens=256),  # long prompts are prefilled in chunks
    )
    outputs = run(engine, cases)  # also checks the block pool after every step
    return engine, [outputs[i] for i in range(len(cases))]


@needs_ops
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fused_engine_equals_generate(arch: str, model_dirs: dict[str, Path]) -> None:
    """Mistral with a 16-token sliding window (most test prompts outrun it)."""
    model_dir = model_dirs[arch]
    cases = make_cases(12, seed=7, vocab=AutoConfig.from_pretrained(model_dir).vocab_size)
    engine, got = engine_outputs(model_dir, cases, fuse=True)
    base = engine.runner.model.model
    assert all(type(layer) is FusedDecoderLayer for layer in base.layers)
    assert type(base.norm) is FusedRMSNorm
    assert got == reference_outputs(model_dir, cases)


def test_other_architectures_keep_their_layers_and_say_why(model_dirs: dict[str, Path]) -> None:
    """Gemma 3 and Qwen 3 (norms on q and k, Gemma's (1 + w) norm) are not Llama's layer."""
    for arch in ("gemma3", "qwen3"):
        engine = LLMEngine(
            ModelConfig(str(model_dirs[arch]), dtype="float32", device="cpu"),
            CacheConfig(num_blocks=16),
        )
        model = engine.runner.model
        assert "decoder layers are not one of" in (fused_layers.why_not_fusable(model) or "")
        assert not any(isinstance(m, FusedDecoderLayer) for m in model.modules())


def test_without_a_compiler_the_engine_keeps_transformers_layers(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    load_ops.cache_clear()
    try:
        vocab = AutoConfig.from_pretrained(model_dirs["llama"]).vocab_size
        cases = make_cases(3, seed=3, vocab=vocab)
        engine, got = engine_outputs(model_dirs["llama"], cases, fuse=True)
        assert not any(isinstance(m, FusedDecoderLayer) for m in engine.runner.model.modules())
        assert got == reference_outputs(model_dirs["llama"], cases)
    finally:
        monkeypatch.undo()
        load_ops.cache_clear()


@needs_ops
def test_fused_and_unfused_prompt_logprobs_agree_in_bfloat16(model_dirs: dict[str, Path]) -> None:
    """bfloat16 rounds where transformers' modules round: the logprob of each of 80 prompt
    tokens agrees with transformers' layers' to bfloat16's precision."""
    per_system = []
    for fuse in (True, False):
        engine = LLMEngine(
            ModelConfig(str(model_dirs["llama"]), dtype="bfloat16", device="cpu", fuse_layers=fuse),
            CacheConfig(block_size=16, num_blocks=64),
        )
        prompt = [(i * 37) % 200 + 10 for i in range(80)]
        engine.add_request("0", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
        got: list = []
        while engine.has_unfinished_requests():
            got += [o for o in engine.step() if o.finished]
        logprobs = got[0].prompt_logprobs[1:]
        per_system.append(torch.tensor([d[t] for d, t in zip(logprobs, prompt[1:])]))
    fused, plain = per_system
    assert (fused - plain).abs().max() < 0.05
    assert (fused - plain).abs().mean() < 0.01


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_rounds_alike_alone_and_in_a_prefill_chunk(dtype: torch.dtype) -> None:
    """Regression (streamed logprobs differed from the whole answer's by 1e-6 after a
    prefix-cache hit): each op's row is bit-identical whether the call has 1 row or 64, so a
    token computed in a decode step and in a prefill chunk gets the same logits."""
    torch.manual_seed(1)
    o, rows = ops(dtype), 64
    x, y = torch.randn(rows, 1280).to(dtype), torch.randn(rows, 1280).to(dtype)
    w = torch.randn(1280).to(dtype)
    cos, sin = torch.randn(rows, 64).to(dtype), torch.randn(rows, 64).to(dtype)
    last = slice(rows - 1, rows)
    assert torch.equal(o.silu_mul(x, y)[last], o.silu_mul(x[last], y[last]))
    assert torch.equal(o.rms_norm(x, w, 1e-6)[last], o.rms_norm(x[last], w, 1e-6))
    total, normed = o.add_rms_norm(x, y, w, 1e-6)
    one_total, one_normed = o.add_rms_norm(x[last], y[last], w, 1e-6)
    assert torch.equal(total[last], one_total) and torch.equal(normed[last], one_normed)
    many, one = x.clone(), x[last].clone()
    o.rotary(many, 20, cos, sin)
    o.rotary(one, 20, cos[last].contiguous(), sin[last].contiguous())
    assert torch.equal(many[last], one)

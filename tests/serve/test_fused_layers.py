"""The fused decoder layers (`serve/model/fused_layers.py`): each kernel against the
transformers module it replaces, and the engine with them against `generate`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.model import fused_layers
from serve.model.fused_layers import FusedDecoderLayer, FusedRMSNorm, FusedSandwichLayer
from serve.model.fused_ops import FusedOps, NormWeight, load_ops
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


NORMS = {"llama": LlamaRMSNorm, "gemma3": Gemma3RMSNorm}
"""Llama's `w * T(x * inv)` and Gemma's `T(x * inv * (1 + w))` (float32 weight)."""


def make_norm(kind: str, dim: int, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    norm = NORMS[kind](dim, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(dim).to(dtype)
    return norm


@needs_ops
@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_add_rms_norm_equal_the_models_norm(
    kind: str, dtype: torch.dtype, rows: int
) -> None:
    norm = make_norm(kind, 96, dtype, rows)
    a, b = torch.randn(rows, 96).to(dtype), torch.randn(rows, 96).to(dtype)
    with torch.no_grad():
        got = ops(dtype).rms_norm(a, NormWeight.of(norm))
        total, normed = ops(dtype).add_rms_norm(a, b, NormWeight.of(norm))
    # the mean's sum is ordered differently: a few float32 ulps, one bfloat16 rounding step
    ulps = {torch.float32: 8, torch.bfloat16: 1}[dtype]
    assert ulps_apart(got, norm(a)) <= ulps
    assert torch.equal(total, a + b)
    assert ulps_apart(normed, norm(a + b)) <= ulps


@needs_ops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("last", [True, False])
def test_norm_add_rms_norm_is_gemmas_sandwich(dtype: torch.dtype, last: bool) -> None:
    """Gemma 3's `residual + post_norm(attention)` and the next pre-norm of that sum (none
    after the layer's MLP): exactly `rms_norm` and the add composed (whose accuracy against
    transformers' norms the test above bounds)."""
    post, pre = make_norm("gemma3", 64, dtype, 1), make_norm("gemma3", 64, dtype, 2)
    a, residual = torch.randn(33, 64).to(dtype) * 5, torch.randn(33, 64).to(dtype)
    o = ops(dtype)
    total, normed = o.norm_add_rms_norm(
        a, NormWeight.of(post), residual, None if last else NormWeight.of(pre)
    )
    assert torch.equal(total, residual + o.rms_norm(a, NormWeight.of(post)))
    if last:
        assert normed is None
    else:
        assert normed is not None and torch.equal(normed, o.rms_norm(total, NormWeight.of(pre)))


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
@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_q_k_norms_then_rotary_in_place_equal_the_attentions(kind: str, dtype: torch.dtype) -> None:
    """Qwen 3's (Llama-style) and Gemma 3's per-head q/k norms before the rotary embedding, in
    place on a column slice: exactly the kernels' norm then rotation, and transformers' result
    within the norm's rounding."""
    torch.manual_seed(0)
    t, heads, d = 21, 3, 32
    qkv = torch.randn(t, 2 * heads * d).to(dtype) * 3
    q, rest_before = qkv[:, : heads * d], qkv[:, heads * d :].clone()
    q_before = q.clone()
    norm = make_norm(kind, d, dtype, 5)
    angles = torch.rand(t, d // 2) * 50
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    o = ops(dtype)
    o.rotary(q, heads, cos, sin, NormWeight.of(norm))
    assert torch.equal(qkv[:, heads * d :], rest_before)
    composed = o.rms_norm(q_before.reshape(t * heads, d), NormWeight.of(norm)).view(t, heads * d)
    o.rotary(composed, heads, cos, sin)
    assert torch.equal(q, composed)
    with torch.no_grad():
        normed = norm(q_before.view(1, t, heads, d)).transpose(1, 2)
    want, _ = apply_rotary_pos_emb(normed, normed, cos[None], sin[None])
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(q, want.transpose(1, 2).reshape(t, -1), rtol=tol, atol=tol)


ACTS = {"silu": (0, F.silu), "gelu_tanh": (1, lambda x: F.gelu(x, approximate="tanh"))}


@needs_ops
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_act_mul_equals_act_times_up_over_the_whole_range(act: str, dtype: torch.dtype) -> None:
    """Gate values from -200 to 200 (past exp's float32 range both ways) and the zeros. GELU
    within 1e-6 absolute (1e-5 x up in bfloat16) where its value is far below one: there
    torch's `1 + tanh` cancels (its result at x = -5 is off by tens of percent, or 0), the
    kernel's `x sigmoid(2 inner)` does not."""
    gate_up = torch.cat([torch.linspace(-200, 200, 8001), torch.randn(8001) * 4]).to(dtype)
    gate_up = gate_up[: 2 * 8000].view(8, 2000)
    gate, up = gate_up[:, :1000], gate_up[:, 1000:]
    code, fn = ACTS[act]
    got = ops(dtype).act_mul(gate, up, code)
    want = fn(gate) * up
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    atol = 1e-30 if act == "silu" else {torch.float32: 1e-6, torch.bfloat16: 1e-5}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=atol)


def engine_outputs(model_dir: Path, cases: list[Case], fuse: bool) -> tuple[LLMEngine, list]:
    engine = LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cpu", fuse_layers=fuse),
        CacheConfig(block_size=16, num_blocks=512),
        SchedulerConfig(max_num_batched_tokens=256),  # long prompts are prefilled in chunks
    )
    outputs = run(engine, cases)  # also checks the block pool after every step
    return engine, [outputs[i] for i in range(len(cases))]


@needs_ops
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "gemma3"])
def test_fused_engine_equals_generate(arch: str, model_dirs: dict[str, Path]) -> None:
    """Mistral with a 16-token sliding window, Gemma 3 with a 16-token window on its local
    layer (most test prompts outrun them); Qwen 3 and Gemma 3 with q/k norms."""
    model_dir = model_dirs[arch]
    cases = make_cases(12, seed=7, vocab=AutoConfig.from_pretrained(model_dir).vocab_size)
    engine, got = engine_outputs(model_dir, cases, fuse=True)
    base = engine.runner.model.model
    layer = FusedSandwichLayer if arch == "gemma3" else FusedDecoderLayer
    assert all(type(m) is layer for m in base.layers)
    assert type(base.norm) is FusedRMSNorm
    assert got == reference_outputs(model_dir, cases)


def test_other_layers_are_kept_and_the_engine_says_why(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A Llama and a Gemma 3 with another activation (exact GELU, not the tanh form) are not
    layers the kernels compute: transformers' stay, still exact."""
    for arch, change in (
        ("llama", {"hidden_act": "gelu"}),
        ("gemma3", {"hidden_activation": "gelu"}),
    ):
        model_dir = tmp_path / arch
        shutil.copytree(model_dirs[arch], model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps(config | change))
        cases = make_cases(3, seed=3, vocab=config["vocab_size"])
        engine, got = engine_outputs(model_dir, cases, fuse=True)
        model = engine.runner.model
        assert "decoder layers are not one of" in (fused_layers.why_not_fusable(model) or "")
        assert not any(isinstance(m, FusedDecoderLayer) for m in model.modules())
        assert got == reference_outputs(model_dir, cases)


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
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fused_and_unfused_prompt_logprobs_agree_in_bfloat16(
    arch: str, model_dirs: dict[str, Path]
) -> None:
    """bfloat16 rounds where transformers' modules round: the logprob of each of 80 prompt
    tokens agrees with transformers' layers' to bfloat16's precision."""
    per_system = []
    for fuse in (True, False):
        engine = LLMEngine(
            ModelConfig(str(model_dirs[arch]), dtype="bfloat16", device="cpu", fuse_layers=fuse),
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
    cos, sin = torch.randn(rows, 64).to(dtype), torch.randn(rows, 64).to(dtype)
    last = slice(rows - 1, rows)
    for act in (0, 1):
        assert torch.equal(o.act_mul(x, y, act)[last], o.act_mul(x[last], y[last], act))
    for kind in NORMS:
        w, head_w = (
            NormWeight.of(make_norm(kind, 1280, dtype, 2)),
            NormWeight.of(make_norm(kind, 64, dtype, 3)),
        )
        assert torch.equal(o.rms_norm(x, w)[last], o.rms_norm(x[last], w))
        total, normed = o.add_rms_norm(x, y, w)
        one_total, one_normed = o.add_rms_norm(x[last], y[last], w)
        assert torch.equal(total[last], one_total) and torch.equal(normed[last], one_normed)
        sandwich, sandwich_normed = o.norm_add_rms_norm(x, w, y, w)
        one_sandwich, one_sandwich_normed = o.norm_add_rms_norm(x[last], w, y[last], w)
        assert sandwich_normed is not None and one_sandwich_normed is not None
        assert torch.equal(sandwich[last], one_sandwich)
        assert torch.equal(sandwich_normed[last], one_sandwich_normed)
        for norm in (None, head_w):
            many, one = x.clone(), x[last].clone()
            o.rotary(many, 20, cos, sin, norm)
            o.rotary(one, 20, cos[last].contiguous(), sin[last].contiguous(), norm)
            assert torch.equal(many[last], one)

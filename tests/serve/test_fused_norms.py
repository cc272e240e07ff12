"""One-pass RMSNorm: swapped only where bitwise equal to the model's own norm, logits unchanged
on every tiny architecture (Gemma's `1 + weight` and q/k norms included), on by default in the
engine with the same greedy tokens as without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from serve.core.config import CacheConfig, ModelConfig
from serve.core.sampling_params import SamplingParams
from serve.engine.llm_engine import LLMEngine
from serve.model.fused_norms import FusedNorm, fuse_rms_norms


def _norm_count(model: nn.Module) -> int:
    return sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_fused_norms_give_bitwise_the_same_logits(
    model_dirs: dict[str, Path], arch: str, dtype: torch.dtype
) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=dtype).eval()
    ids = torch.randint(0, 200, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(ids).logits
    norms = _norm_count(model)
    assert fuse_rms_norms(model, dtype) == norms > 0
    assert _norm_count(model) == 0
    assert sum(isinstance(m, FusedNorm) for m in model.modules()) == norms
    with torch.inference_mode():
        got = model(ids).logits
    assert torch.equal(got, want)


def test_a_norm_of_another_form_is_kept() -> None:
    """A module named like an RMSNorm that computes something else (eps outside the root) is
    left as it is."""

    class OddRMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16))
            self.eps = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)

    model = nn.Sequential(OddRMSNorm(), nn.Linear(16, 16))
    assert fuse_rms_norms(model, torch.float32) == 0
    assert type(model[0]).__name__ == "OddRMSNorm"


def test_engine_fuses_norms_by_default_with_the_same_greedy_tokens(
    model_dirs: dict[str, Path],
) -> None:
    outputs, fused = {}, {}
    for fuse in (True, False):
        engine = LLMEngine(
            ModelConfig(str(model_dirs["gemma3"]), "float32", "cpu", fuse_norms=fuse),
            CacheConfig(num_blocks=256),
        )
        model = engine.runner.model
        fused[fuse] = sum(isinstance(m, FusedNorm) for m in model.modules())
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for i, prompt in enumerate([[5, 6, 7], list(range(20, 90))]):
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outputs[fuse] = done
    assert fused[True] == 2 * 6 + 1 and fused[False] == 0  # 4 + q/k norms per layer, final
    assert outputs[True] == outputs[False]


def test_int8_kv_key_smoothing_reads_the_fused_k_norms(model_dirs: dict[str, Path]) -> None:
    """Regression: the int8 KV cache's key smoothing reads each `k_norm`'s weight; fused norms
    keep it (the engine fuses before it builds the cache)."""
    from serve.model.kv_cache import layer_key_smoothing

    model = AutoModelForCausalLM.from_pretrained(model_dirs["gemma3"], dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.copy_(torch.linspace(-0.9, 3.0, 16))
    want = layer_key_smoothing(model)
    assert fuse_rms_norms(model, torch.float32) > 0
    got = layer_key_smoothing(model)
    assert want.keys() == got.keys() and all(w is not None for w in want.values())
    assert all(torch.equal(got[i], want[i]) for i in want)  # type: ignore[arg-type]

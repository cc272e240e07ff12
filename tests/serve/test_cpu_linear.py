"""oneDNN-prepacked linears: same products as F.linear, only plain float32/bfloat16 layers replaced,
on by default in the engine with the same greedy tokens as without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from serve.core.config import CacheConfig, ModelConfig
from serve.core.sampling_params import SamplingParams
from serve.engine.llm_engine import LLMEngine
from serve.model.cpu_linear import PackedLinear, prepack_linears

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 48), (2, 5, 48)])
def test_packed_linear_matches_f_linear(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    want = linear(x)
    got = PackedLinear(linear)(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


BF16_PACKS = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="this CPU has no AVX-512 BW/VL/DQ or AVX-NE-CONVERT: oneDNN cannot pack bfloat16",
)


@BF16_PACKS
def test_packed_bfloat16_linear_matches_f_linear() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    got = PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, linear(x), rtol=1.6e-2, atol=1e-2)


def test_only_plain_float32_and_bfloat16_linears_are_replaced() -> None:
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(
        nn.Linear(8, 8), nn.Linear(8, 8).bfloat16(), nn.Linear(8, 8).half(), Custom(8, 8)
    )
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert prepack_linears(model) == (2 if bf16 else 1)
    names = [type(m).__name__ for m in model]
    assert names == ["PackedLinear", "PackedLinear" if bf16 else "Linear", "Linear", "Custom"]


def test_bfloat16_models_are_not_prepacked_where_the_cpu_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: on an AVX2-only CPU the bf16 reorder raised inside the engine's load."""
    from serve.model import cpu_linear

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not cpu_linear.can_prepack(torch.device("cpu"), torch.bfloat16)
    assert cpu_linear.can_prepack(torch.device("cpu"), torch.float32)
    model = nn.Sequential(nn.Linear(8, 8).bfloat16())
    assert prepack_linears(model) == 0


def test_engine_prepacks_by_default_with_the_same_greedy_tokens(
    model_dirs: dict[str, Path],
) -> None:
    outputs, packed = {}, {}
    for prepack in (True, False):
        engine = LLMEngine(
            ModelConfig(str(model_dirs["llama"]), "float32", "cpu", prepack_linears=prepack),
            CacheConfig(num_blocks=256),
        )
        packed[prepack] = sum(isinstance(m, PackedLinear) for m in engine.runner.model.modules())
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for i, prompt in enumerate([[5, 6, 7], list(range(20, 90))]):
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outputs[prepack] = done
    assert packed[True] == 2 * 7 + 1 and packed[False] == 0  # 7 per layer + lm_head
    assert outputs[True] == outputs[False]

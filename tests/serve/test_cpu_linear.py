"""oneDNN-prepacked linears: same products as F.linear, only plain float32/bfloat16 layers replaced,
on by default in the engine with the same greedy tokens as without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from serve.core.config import CacheConfig, ModelConfig
from serve.core.sampling_params import SamplingParams
from serve.engine.llm_engine import LLMEngine
from serve.model.cpu_linear import GroupedLinear, PackedLinear, prepack_linears

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
    assert prepack_linears(model) == 2
    names = [type(m).__name__ for m in model]
    assert names == [
        "PackedLinear",
        "PackedLinear" if bf16 else "WidenedLinear",
        "Linear",
        "Custom",
    ]


def test_bfloat16_models_are_widened_not_prepacked_where_the_cpu_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: on an AVX2-only CPU the bf16 reorder raised inside the engine's load. There
    a bf16 linear multiplies in float32 from `WIDEN_ROWS` rows (its output rounded to bf16, the
    same numbers as `F.linear`'s up to summation order), and a tied weight stays shared."""
    from serve.model import cpu_linear

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setattr(cpu_linear, "WIDEN_ROWS", 4)
    torch.manual_seed(0)
    linear = nn.Linear(64, 300).bfloat16()
    model = nn.Sequential(linear)
    assert prepack_linears(model) == 1
    widened = model[0]
    assert isinstance(widened, cpu_linear.WidenedLinear) and widened.weight is linear.weight
    for rows in (1, 3, 4, 40):
        x = torch.randn(2, rows, 64).bfloat16()
        y = widened(x)
        assert y.dtype == torch.bfloat16 and y.shape == (2, rows, 300)
        exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
        # within one bfloat16 rounding of the exact product, as `F.linear` in bf16 is
        assert torch.allclose(y.double(), exact, rtol=2**-8, atol=1e-4)
        if rows < 4:
            assert torch.equal(y, F.linear(x, linear.weight, linear.bias))


def test_engine_prepacks_by_default_with_the_same_greedy_tokens(
    model_dirs: dict[str, Path],
) -> None:
    outputs, packed = {}, {}
    for prepack in (True, False):
        engine = LLMEngine(
            ModelConfig(str(model_dirs["llama"]), "float32", "cpu", prepack_linears=prepack),
            CacheConfig(num_blocks=256),
        )
        kinds = [type(m) for m in engine.runner.model.modules()]
        packed[prepack] = (kinds.count(PackedLinear), kinds.count(GroupedLinear))
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for i, prompt in enumerate([[5, 6, 7], list(range(20, 90))]):
            engine.add_request(str(i), prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outputs[prepack] = done
    # per layer q/k/v and gate/up grouped, o and down packed alone; and lm_head
    assert packed[True] == (2 * 2 + 1, 2 * 5) and packed[False] == (0, 0)
    assert outputs[True] == outputs[False]


class _Attention(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(48, n, bias=bias) for n in (64, 32, 32))
        self.o_proj = nn.Linear(64, 48)


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_projections_equal_each_linear_and_drop_the_product(bias: bool) -> None:
    torch.manual_seed(0)
    attn = _Attention(bias)
    reference = {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert prepack_linears(attn) == 4
    assert [type(attn.q_proj), type(attn.v_proj), type(attn.o_proj)] == [
        GroupedLinear, GroupedLinear, PackedLinear
    ]  # fmt: skip
    x = torch.randn(3, 5, 48)
    for name in ("q_proj", "k_proj", "v_proj"):  # the order transformers calls them in
        torch.testing.assert_close(getattr(attn, name)(x), reference[name](x), rtol=1e-5, atol=1e-5)
    assert attn.q_proj.group.x is None and attn.q_proj.group.y is None  # the last one dropped it
    other = torch.randn(2, 48)  # out of order, and a member seeing another input: still right
    for name, inp in (("v_proj", x), ("k_proj", other), ("q_proj", x)):
        torch.testing.assert_close(
            getattr(attn, name)(inp), reference[name](inp), rtol=1e-5, atol=1e-5
        )


def test_groups_of_mixed_inputs_or_kinds_stay_separate() -> None:
    attn = _Attention(bias=False)
    attn.k_proj = nn.Linear(48, 32, bias=True)  # bias on one member only
    assert prepack_linears(attn) == 4
    assert {type(attn.q_proj), type(attn.k_proj), type(attn.v_proj)} == {PackedLinear}
    unmerged = _Attention(bias=False)
    assert prepack_linears(unmerged, merge_groups=False) == 4
    assert type(unmerged.q_proj) is PackedLinear

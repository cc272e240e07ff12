"""AWQ's scales change the weights, not the function: folded into the op before (Llama's RMSNorm,
Gemma's (1 + w) RMSNorm, up_proj's rows, v_proj's rows) they leave every layer's output as it
was; and the searched scales quantize better than none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from compress.awq import AWQSettings, apply_awq, fold_inverse_scale, scale_groups
from compress.calibration import record_inputs
from tests.serve.conftest import make_model


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory
) -> torch.nn.Module:
    path = make_model(request.param, tiny_model_dir, tmp_path_factory.mktemp(request.param))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def test_folded_scales_leave_the_layer_function_unchanged(model: torch.nn.Module) -> None:
    rows = torch.randint(5, 400, (2, 40))
    batches = record_inputs(model, rows, 2)[0]
    layer = model.model.layers[0]
    x, kwargs = batches[0]
    before = layer(x, **kwargs)
    torch.manual_seed(1)
    groups = scale_groups(layer)
    assert [g.inspect for g in groups][:3] == ["self_attn", "mlp", "mlp.down_proj"]
    for group in groups:
        scales = torch.rand(layer.get_submodule(group.linears[0]).in_features) + 0.5
        fold_inverse_scale(layer.get_submodule(group.prev), scales)
        for name in group.linears:
            layer.get_submodule(name).weight.mul_(scales)
    after = layer(x, **kwargs)
    before = before[0] if isinstance(before, tuple) else before
    after = after[0] if isinstance(after, tuple) else after
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_awq_records_its_scales_and_changes_weights(model: torch.nn.Module) -> None:
    from compress.packed import PackedFormat

    rows = torch.randint(5, 400, (4, 64))
    batches = record_inputs(model, rows, 2)[0]
    layer = model.model.layers[0]
    before = layer.mlp.gate_proj.weight.clone()
    record = apply_awq(layer, batches, PackedFormat(4, 32), AWQSettings(grid=5))
    assert set(record) >= {"self_attn", "mlp", "mlp.down_proj"}
    assert not torch.equal(layer.mlp.gate_proj.weight, before)

"""`auto` precision: bfloat16 only where this machine computes it fast (bf16 autocast made a
SmolLM2 distillation step take 128 s on an AVX2-only CPU)."""

from __future__ import annotations

import pytest
import torch

from compress import training
from compress.distill import DistillParams
from compress.lora import LoraParams
from evals.settings import Evals


@pytest.mark.parametrize("fast", [True, False])
def test_auto_resolves_by_the_machine(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    monkeypatch.setattr(training, "fast_bf16", lambda: fast)
    assert training.resolve_precision("auto") == ("bf16" if fast else "no")
    assert training.resolve_precision("bf16") == "bf16" and training.resolve_precision("no") == "no"
    assert Evals(dtype="auto").quality_dtype() == ("bfloat16" if fast else "float32")
    assert Evals(dtype="float32").quality_dtype() == "float32"
    # the stored results' key follows the dtype actually used
    assert (
        Evals(dtype="auto").quality_key()
        == Evals(dtype="bfloat16" if fast else "float32").quality_key()
    )


def test_fast_bf16_follows_onednn_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training.fast_bf16() == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_steps_accept_auto_and_refuse_other_values() -> None:
    from catalog.data import NAMED

    context = {"data": NAMED}
    lora = {"data": "corpus", "mixed_precision": "auto"}
    assert LoraParams.model_validate(lora, context=context).mixed_precision == "auto"
    distill = {"layers": 2, "mixed_precision": "auto"}
    assert DistillParams.model_validate(distill, context=context).mixed_precision == "auto"
    with pytest.raises(ValueError, match="'no', 'bf16' or 'auto'"):
        LoraParams.model_validate({**lora, "mixed_precision": "fp16"}, context=context)


def test_adamw_is_fused_where_its_kernel_runs_and_steps_as_the_default_does() -> None:
    weights = [torch.randn(64, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    assert training.fused_adamw([torch.nn.Parameter(w) for w in weights])
    assert not training.fused_adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))])
    assert not training.fused_adamw([])
    moved = []
    for fused in (True, False):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.95), fused=fused)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = torch.sin(p.detach() * (step + i + 1))
            opt.step()
        moved.append(torch.cat([p.detach().flatten() for p in params]))
    assert not torch.equal(moved[0], torch.cat([w.flatten() for w in weights]))
    torch.testing.assert_close(moved[0], moved[1], rtol=1e-6, atol=1e-6)

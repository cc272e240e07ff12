"""KL divergence, top-1 agreement and bits per byte against a reference, checked by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from evals.divergence import ReferenceMemo, divergence, window_log_probs


def _two_models_and_windows(
    tiny_model_dir: Path,
) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """The tiny model, a copy with noise added to every weight, and 5 windows of 24 ids."""
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    rows = torch.randint(6, 500, (5, 24), generator=torch.Generator().manual_seed(1))
    return ref, other, rows


def test_divergence_equals_a_direct_computation(tiny_model_dir: Path) -> None:
    ref, other, rows = _two_models_and_windows(tiny_model_dir)
    stats = divergence(ref, other, rows, target_bytes=400, batch_size=2)

    with torch.no_grad():
        p = torch.log_softmax(ref(input_ids=rows).logits[:, :-1], -1)
        q = torch.log_softmax(other(input_ids=rows).logits[:, :-1], -1)
    kl = (p.exp() * (p - q)).sum(-1)
    agree = (p.argmax(-1) == q.argmax(-1)).float()
    nll_q = -q.gather(-1, rows[:, 1:, None])[..., 0]
    assert stats["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-5)
    assert stats["kl_stderr"] == pytest.approx(kl.mean(-1).std().item() / math.sqrt(5), rel=1e-4)
    assert stats["top1_agreement"] == pytest.approx(agree.mean().item())
    assert stats["perplexity"] == pytest.approx(math.exp(nll_q.mean().item()), rel=1e-5)
    assert stats["bits_per_byte"] == pytest.approx(nll_q.sum().item() / math.log(2) / 400, rel=1e-5)
    assert stats["tokens"] == 5 * 23 and stats["windows"] == 5
    assert 0 < stats["kl_median"] <= stats["kl_p99"]
    # per window, in the windows' order: what the report pairs across variants
    nll_p = -p.gather(-1, rows[:, 1:, None])[..., 0]
    assert stats["window_kl"] == pytest.approx(kl.mean(-1).tolist(), rel=1e-5)
    assert stats["window_agreement"] == pytest.approx(agree.mean(-1).tolist())
    assert stats["window_nll"] == pytest.approx(nll_q.mean(-1).tolist(), rel=1e-5)
    assert stats["window_reference_nll"] == pytest.approx(nll_p.mean(-1).tolist(), rel=1e-5)

    itself = divergence(ref, ref, rows, target_bytes=400)
    assert itself["kl_mean"] == 0.0 and itself["top1_agreement"] == 1.0
    assert itself["perplexity"] == pytest.approx(itself["reference_perplexity"])
    assert itself["reference_perplexity"] == pytest.approx(stats["reference_perplexity"])


def test_a_side_given_as_its_scores_gives_the_same_figures(tiny_model_dir: Path) -> None:
    """The pipeline scores the reference once and hands its log-probabilities to every variant."""
    ref, other, rows = _two_models_and_windows(tiny_model_dir)
    scores = window_log_probs(ref, rows, batch_size=2)
    assert [tuple(s.shape) for s in scores] == [(2, 23, 512), (2, 23, 512), (1, 23, 512)]
    direct = divergence(ref, other, rows, target_bytes=400, batch_size=2)
    assert divergence(scores, other, rows, target_bytes=400, batch_size=2) == direct
    itself = divergence(ref, ref, rows, target_bytes=400, batch_size=2)
    assert divergence(scores, scores, rows, target_bytes=400, batch_size=2) == itself


def test_the_reference_memo_keeps_scores_within_its_budget() -> None:
    one = [torch.zeros(2, 3, 4)]  # 96 bytes
    memo = ReferenceMemo(budget_bytes=200)
    assert memo.put("a", one) and memo.get("a") is one
    assert memo.put("b", [torch.zeros(2, 3, 4)])
    assert not memo.put("c", [torch.zeros(2, 3, 4)])  # 288 > 200: computed again when asked
    assert memo.get("c") is None and memo.used == 192
    assert not memo.put("a", [torch.ones(2, 3, 4)]) and memo.get("a") is one

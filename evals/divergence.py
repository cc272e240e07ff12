"""How far a variant's next-token distributions are from a reference model's (llama.cpp's
quantization measures): mean KL divergence, top-1 agreement, and both models' perplexity and bits
per byte.

Model: both models score the same windows of held-out text in lockstep; either side may instead
be given as its log-probabilities on those windows (`Scores`, from `window_log_probs`), so a
reference measured against many variants runs once (`ReferenceMemo` keeps them within a byte
budget). The reference scored against itself gives its own perplexity and bits per byte (KL 0,
agreement 1) with one forward per window.
Per token t: KL(P_ref(.|x<t) || P_var(.|x<t)) in nats, and whether the two argmaxes agree. Means
are over every scored token; their standard errors are over windows (tokens of one window are
correlated, windows are nearly independent), so they are honest about the sample size. Each
window's mean KL, agreement and both NLLs are kept too (`window_*`): the two models scored the same
windows, so the report pairs them (the NLL difference per window gives the perplexity ratio's
interval).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

BATCH = 8
"""Windows per forward pass."""

Scores = list[torch.Tensor]
"""A model's next-token log-probabilities on windows: one float32 [windows, seq - 1, vocab]
tensor per batch of `BATCH` windows, on the CPU."""


def _log_probs(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(input_ids=batch).logits[:, :-1].float(), dim=-1)


@torch.no_grad()
def window_log_probs(model: torch.nn.Module, rows: torch.Tensor, batch_size: int = BATCH) -> Scores:
    model.eval()
    device = next(model.parameters()).device
    return [
        _log_probs(model, rows[i : i + batch_size].to(device)).cpu()
        for i in range(0, len(rows), batch_size)
    ]


class ReferenceMemo:
    """Reference `Scores` by key, kept while their sum stays within `budget_bytes` (a set that
    does not fit is not kept: the next variant computes it again)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes, self.used = budget_bytes, 0
        self.entries: dict[Hashable, Scores] = {}

    def get(self, key: Hashable) -> Scores | None:
        return self.entries.get(key)

    def put(self, key: Hashable, scores: Scores) -> bool:
        size = sum(t.numel() * t.element_size() for t in scores)
        if key in self.entries or self.used + size > self.budget_bytes:
            return False
        self.entries[key], self.used = scores, self.used + size
        return True


def _window_stats(
    ref: torch.Tensor, var: torch.Tensor, batch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token (batch, seq - 1) from both sides' log-probabilities: KL, agreement, and both
    models' NLL of the next token."""
    kl = (ref.exp() * (ref - var)).sum(-1).clamp_min(0.0)  # rounding can give -1e-9
    agree = (ref.argmax(-1) == var.argmax(-1)).float()
    target = batch[:, 1:].unsqueeze(-1)
    return kl, agree, -ref.gather(-1, target)[..., 0], -var.gather(-1, target)[..., 0]


def scored_bytes(tokenizer: Any, rows: torch.Tensor) -> int:
    """UTF-8 bytes of every window's tokens after the first: the text `divergence`'s NLL is paid
    for (its `target_bytes`)."""
    return sum(len(str(tokenizer.decode(r[1:])).encode()) for r in rows.tolist())


def _mean_and_stderr(per_window: torch.Tensor) -> tuple[float, float]:
    n = per_window.numel()
    mean = per_window.mean().item()
    stderr = per_window.std(unbiased=True).item() / math.sqrt(n) if n > 1 else float("nan")
    return mean, stderr


@torch.no_grad()
def divergence(
    reference: torch.nn.Module | Scores,
    model: torch.nn.Module | Scores,
    rows: torch.Tensor,
    target_bytes: int,
    batch_size: int = BATCH,
) -> dict[str, Any]:
    """KL, agreement, perplexities and bits per byte of `model` against `reference` over `rows`
    (windows of token ids, each scored on its own; `target_bytes`: UTF-8 bytes of every
    window's tokens after the first, the text the NLL is paid for). Either side may be its
    `Scores` on `rows` (computed with the same `batch_size`); the same object on both sides is
    scored once."""
    sides = [m for m in (reference, model) if isinstance(m, torch.nn.Module)]
    for m in sides:
        m.eval()
    device = next(sides[-1].parameters()).device if sides else torch.device("cpu")

    def side(m: torch.nn.Module | Scores, index: int, batch: torch.Tensor) -> torch.Tensor:
        return m[index].to(device) if isinstance(m, list) else _log_probs(m, batch)

    parts: list[tuple[torch.Tensor, ...]] = []
    for index, start in enumerate(range(0, len(rows), batch_size)):
        batch = rows[start : start + batch_size].to(device)
        ref = side(reference, index, batch)
        var = ref if model is reference else side(model, index, batch)
        parts.append(_window_stats(ref, var, batch))
    kl, agree, ref_nll, var_nll = (torch.cat(p).cpu() for p in zip(*parts, strict=True))
    kl_mean, kl_stderr = _mean_and_stderr(kl.mean(-1))
    agree_mean, agree_stderr = _mean_and_stderr(agree.mean(-1))
    flat = kl.flatten()
    return {
        "kl_mean": kl_mean,
        "kl_stderr": kl_stderr,
        "kl_median": flat.median().item(),
        "kl_p99": torch.quantile(flat, 0.99).item(),
        "top1_agreement": agree_mean,
        "top1_agreement_stderr": agree_stderr,
        "perplexity": math.exp(var_nll.mean().item()),
        "reference_perplexity": math.exp(ref_nll.mean().item()),
        "bits_per_byte": var_nll.sum().item() / math.log(2) / target_bytes,
        "reference_bits_per_byte": ref_nll.sum().item() / math.log(2) / target_bytes,
        "windows": len(rows),
        "tokens": flat.numel(),
        "window_kl": kl.mean(-1).tolist(),
        "window_agreement": agree.mean(-1).tolist(),
        "window_nll": var_nll.mean(-1).tolist(),
        "window_reference_nll": ref_nll.mean(-1).tolist(),
    }

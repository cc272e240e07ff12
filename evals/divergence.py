"""How far a variant's next-token distributions are from a reference model's (llama.cpp's
quantization measures): mean KL divergence, top-1 agreement, and both models' perplexity and bits
per byte.

Model: both models score the same windows of held-out text in lockstep (no logits are stored);
the reference scored against itself gives its own perplexity and bits per byte (KL 0, agreement
1) with one forward per window.
Per token t: KL(P_ref(.|x<t) || P_var(.|x<t)) in nats, and whether the two argmaxes agree. Means
are over every scored token; their standard errors are over windows (tokens of one window are
correlated, windows are nearly independent), so they are honest about the sample size. Each
window's mean KL, agreement and both NLLs are kept too (`window_*`): the two models scored the same
windows, so the report pairs them (the NLL difference per window gives the perplexity ratio's
interval).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _window_stats(
    reference: torch.nn.Module, model: torch.nn.Module, batch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token (batch, seq - 1): KL, agreement, and both models' NLL of the next token."""
    ref = torch.log_softmax(reference(input_ids=batch).logits[:, :-1].float(), dim=-1)
    if model is reference:
        var = ref
    else:
        var = torch.log_softmax(model(input_ids=batch).logits[:, :-1].float(), dim=-1)
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
    reference: torch.nn.Module,
    model: torch.nn.Module,
    rows: torch.Tensor,
    target_bytes: int,
    batch_size: int = 8,
) -> dict[str, Any]:
    """KL, agreement, perplexities and bits per byte of `model` against `reference` over `rows`
    (windows of token ids, each scored on its own; `target_bytes`: UTF-8 bytes of every
    window's tokens after the first, the text the NLL is paid for)."""
    reference.eval()
    model.eval()
    device = next(model.parameters()).device
    parts: list[tuple[torch.Tensor, ...]] = []
    for i in range(0, len(rows), batch_size):
        parts.append(_window_stats(reference, model, rows[i : i + batch_size].to(device)))
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

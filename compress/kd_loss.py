"""Distillation losses: the KL from the teacher's distribution to the student's, over the whole
vocabulary or over the teacher's top-k tokens cached per training window.

Model: at temperature T, p = softmax(teacher / T), q = softmax(student / T), per position.
- full: KL(p || q) summed over the vocabulary, the teacher run on every batch;
- top-k: the teacher's k most likely tokens keep their own probabilities and every other token
  shares one "rest" bucket: KL over k + 1 outcomes, p's and q's rest being 1 - their top-k mass.
  It equals the full KL when k is the vocabulary, and it never exceeds it (merging outcomes
  cannot raise a KL divergence). The teacher's top-k log-probabilities, token ids and rest are
  computed the first time a window is trained on and reused when it comes back (later epochs),
  so those steps skip the teacher's forward pass.
Both are averaged over positions (`batchmean` over the flattened [batch x positions] rows).
`kd_and_ce` is the full KL blended with the student's cross-entropy on the next tokens, the
distill step's loss, in one pass over the vocabulary per block of rows: the gradient with
respect to the student's logits has a closed form (`(q_T - p_T) / T` for the KL, `q - onehot`
for the cross-entropy), so it is computed with the loss and no [rows x vocabulary] float32
intermediate outlives its block (the unfused ops kept several and walked them again backward:
0.67 s of a 4.3 s SmolLM2 KD step against 0.29 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

TINY = 1e-12
"""Probabilities are clamped here before a log: a rest bucket can be empty (k = vocabulary)."""


def full_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    s = F.log_softmax(student_logits.flatten(0, -2).float() / temperature, -1)
    t = F.log_softmax(teacher_logits.flatten(0, -2).float() / temperature, -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


BLOCK_BYTES = 4 << 20
"""float32 bytes of logits `kd_and_ce` works on at once: its dozen passes over a block stay in
the CPU's cache (SmolLM2's 49,152-token vocabulary: 21 rows; the loss and its gradient on 508
rows took 0.29 s in blocks of 32 rows, 0.55 s in blocks of 256, 0.67 s unfused)."""


class _KDAndCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        student: torch.Tensor,
        teacher: torch.Tensor,
        labels: torch.Tensor,
        alpha: float,
        temperature: float,
    ) -> torch.Tensor:
        rows, vocab = student.shape
        block = max(1, BLOCK_BYTES // (4 * vocab))
        grad = torch.empty_like(student)
        kl_sum = ce_sum = student.new_zeros((), dtype=torch.float32)
        for start in range(0, rows, block):
            z = student[start : start + block].float()
            log_p = F.log_softmax(teacher[start : start + block].float() / temperature, -1)
            log_q_t = F.log_softmax(z / temperature, -1)
            p = log_p.exp()
            kl_sum = kl_sum + (p * (log_p - log_q_t)).sum()
            block_grad = (log_q_t.exp() - p).mul_(
                alpha * temperature / rows
            )  # T^2 * (q_T - p_T) / T
            log_q = log_q_t if temperature == 1.0 else F.log_softmax(z, -1)
            target = labels[start : start + block, None]
            ce_sum = ce_sum - log_q.gather(-1, target).sum()
            block_grad.add_(log_q.exp_(), alpha=(1 - alpha) / rows)
            block_grad.scatter_add_(
                -1, target, block_grad.new_full(target.shape, -(1 - alpha) / rows)
            )
            grad[start : start + block] = block_grad
        ctx.save_for_backward(grad)
        return (alpha * temperature**2 * kl_sum + (1 - alpha) * ce_sum) / rows

    @staticmethod
    def backward(ctx: Any, upstream: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        return grad * upstream.to(grad.dtype), None, None, None, None


def kd_and_ce(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    alpha: float,
    temperature: float,
) -> torch.Tensor:
    """`alpha * T^2 * full_kl(student, teacher, T) + (1 - alpha) * CE(student, labels)`, both
    averaged over positions; [..., vocab] logits, [...] labels (every position scored). The
    gradient reaches the student's logits in their own dtype (what autograd's cast gives)."""
    vocab = student_logits.shape[-1]
    return _KDAndCE.apply(
        student_logits.reshape(-1, vocab),
        teacher_logits.reshape(-1, vocab),
        labels.reshape(-1),
        alpha,
        temperature,
    )


@dataclass(frozen=True)
class TopK:
    """The teacher's top-k at temperature T, per position: [..., k] log-probabilities and token
    ids, and [...] the probability left to every other token."""

    log_probs: torch.Tensor
    ids: torch.Tensor
    rest: torch.Tensor

    @classmethod
    def of(cls, teacher_logits: torch.Tensor, k: int, temperature: float) -> TopK:
        log_probs = F.log_softmax(teacher_logits.float() / temperature, -1)
        top, ids = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
        rest = (-torch.expm1(top.logsumexp(-1))).clamp_min(0)
        return cls(top, ids, rest)


def top_k_kl(student_logits: torch.Tensor, teacher: TopK, temperature: float) -> torch.Tensor:
    """KL over the teacher's top-k tokens and the rest bucket, averaged over positions."""
    s = F.log_softmax(student_logits.float() / temperature, -1)
    s_top = s.gather(-1, teacher.ids)
    s_rest = torch.log((-torch.expm1(s_top.logsumexp(-1))).clamp_min(TINY))
    top = (teacher.log_probs.exp() * (teacher.log_probs - s_top)).sum(-1)
    rest = teacher.rest * (torch.log(teacher.rest.clamp_min(TINY)) - s_rest)
    return (top + rest).sum() / top.numel()


class TopKCache:
    """The teacher's top-k per training window, keyed by the window's tokens."""

    def __init__(self, k: int, temperature: float) -> None:
        self.k, self.temperature = k, temperature
        self.entries: dict[bytes, TopK] = {}
        self.hits = self.misses = 0

    def get(self, teacher: torch.nn.Module, batch: torch.Tensor) -> TopK:
        """Top-k of the teacher's logits at every position but the last of each window in
        `batch` [b, seq]: cached windows are read, the others run through the teacher once."""
        keys = [row.cpu().numpy().tobytes() for row in batch]
        missing = [i for i, key in enumerate(keys) if key not in self.entries]
        if missing:
            with torch.no_grad():
                logits = teacher(input_ids=batch[missing]).logits[:, :-1]
            found = TopK.of(logits, self.k, self.temperature)
            for j, i in enumerate(missing):
                self.entries[keys[i]] = TopK(found.log_probs[j], found.ids[j].int(), found.rest[j])
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        rows = [self.entries[key] for key in keys]
        return TopK(
            torch.stack([r.log_probs for r in rows]),
            torch.stack([r.ids for r in rows]).long(),
            torch.stack([r.rest for r in rows]),
        )

"""How one request samples and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (as in vLLM): dividing logits by a smaller one overflows."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""The seeds `torch.Generator.manual_seed` takes."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    """Most tokens to generate; 0 computes the prompt only (prompt logprobs)."""
    temperature: float = 1.0
    """0 (or anything below `SAMPLING_EPS`) is greedy."""
    top_k: int | None = None
    """Keep the k most likely tokens; None keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p."""
    seed: int | None = None
    """Seeds this request's own generator: its samples do not depend on the batch it runs in."""
    stop: tuple[str, ...] = ()
    """Stop when the output text contains one of these; the stop string is not returned."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop after generating one of these tokens (kept in the output)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    logprobs: int | None = None
    """Return this many top logprobs for each generated token (0: only the sampled one's)."""
    prompt_logprobs: int | None = None
    """Return the logprob of every prompt token (and this many top ones); such a request
    bypasses the prefix cache, since cached tokens are not run through the model."""

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens < 0:
            problems.append(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            problems.append(f"top_k must be >= 1 or None, got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                problems.append(f"{name} must be in [0, 20], got {value}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            problems.append(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

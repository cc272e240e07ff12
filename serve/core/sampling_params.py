"""How one request samples and when it stops."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (as in vLLM): dividing logits by a smaller one overflows."""
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""The seeds `torch.Generator.manual_seed` takes."""


class OutputKind(enum.Enum):
    """What each of a request's outputs carries (vLLM's `RequestOutputKind`)."""

    CUMULATIVE = "cumulative"
    """Everything so far, at every step (the offline API's tests read it)."""
    DELTA = "delta"
    """Only what is new since the previous output: streams."""
    FINAL_ONLY = "final_only"
    """One output, when the request ends: whole answers."""


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_GRAMMAR_CHARS = 256 << 10
"""Characters of a grammar's spec (a schema as JSON, a regex, a Lark grammar, a choice list):
256 KiB, room for 256 choices of 1,000 characters. Bounds what one grammar costs to compile and
to cache (long schema descriptions do not constrain the output: drop them)."""


@dataclass(frozen=True)
class Grammar:
    """A constraint on the output text. `spec`: the JSON schema (as JSON text), the regex, the
    choices (a JSON list of strings) or the Lark grammar; unused for json_object."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")


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
    """Return the logprob of every prompt token from `prompt_logprobs_from` on (and this many
    top ones); the prefix cache serves such a request only before that position, since cached
    tokens are not run through the model."""
    prompt_logprobs_from: int = 0
    """The first prompt position whose logprob is returned (earlier ones are None): a scorer
    that reads only a continuation shares its context's cached blocks."""
    min_tokens: int = 0
    """End-of-sequence and stop token ids are masked (and stop strings not looked for) until
    this many tokens are out."""
    min_p: float = 0.0
    """Drop tokens whose probability (after temperature) is below min_p x the top one's."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it is already in the output."""
    repetition_penalty: float = 1.0
    """Logits of tokens in the prompt or the output: positive ones divided by it, negative ones
    multiplied (CTRL's penalty, as transformers and vLLM apply it)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the request at the end of its text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    grammar: Grammar | None = None
    """Only tokens that keep the output inside this grammar are sampled."""
    output_kind: OutputKind = OutputKind.CUMULATIVE

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
        if self.prompt_logprobs_from < 0:
            problems.append(f"prompt_logprobs_from must be >= 0, got {self.prompt_logprobs_from}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            problems.append(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            problems.append(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                problems.append(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not (math.isfinite(b) and -100 <= b <= 100) for _, b in self.logit_bias):
            problems.append("logit_bias values must be in [-100, 100]")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def changes_logits(self) -> bool:
        """Whether anything but temperature, top-k and top-p acts on the logits (so even a
        greedy request needs its row processed before the argmax)."""
        return self.processes_row or self.grammar is not None

    @property
    def masked_argmax(self) -> bool:
        """Greedy, and nothing but a grammar's mask (if any) acts on the logits: the token is the
        argmax of the row's allowed tokens (so many such rows share one pass, and a grammar's
        mask can wait until the free argmax is rejected)."""
        return self.greedy and not self.processes_row

    @property
    def processes_row(self) -> bool:
        """Whether min_tokens, a logit bias or a penalty acts on the logits (a grammar's mask
        alone can be applied to many rows at once)."""
        return bool(
            self.min_tokens
            or self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

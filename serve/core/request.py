"""A request inside the engine: its tokens, two counters, and where it stands.

Model: `num_tokens` = prompt + output tokens so far; `num_computed_tokens` = how many of them have
KV in the cache. A request needs `num_tokens - num_computed_tokens` tokens computed; once the last
one is computed, the next token is sampled. A prompt is therefore "many tokens to compute", a
chunked prefill is "some of them this step", decoding is "one", and a preempted request is reset
to `num_computed_tokens = 0` and recomputed, prompt and output alike, with unchanged results.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from serve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    """End-of-sequence ids: the tokenizer's and those the model's generation config lists."""
    adapter_id: int | None = None
    """Selects a LoRA adapter; part of every block hash, so prefixes are shared per adapter."""
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    """Output tokens a step still in flight samples (async scheduling): scheduled as if known,
    appended when that step's update lands. 0 or 1."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    """Hashes of the request's full blocks, in order (chained), extended as tokens arrive."""
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served by the prefix cache at first admission."""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

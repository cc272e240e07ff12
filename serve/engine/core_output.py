"""What the engine core hands its output processor each step: tokens, never text."""

from __future__ import annotations

from dataclasses import dataclass

from serve.core.request import FinishReason


@dataclass
class CoreOutput:
    """What one step did to one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]]
    prompt_logprobs: list[dict[int, float] | None] | None
    """The prompt's logprobs so far: with the request's first token and when it finishes."""
    finish_reason: FinishReason | None
    num_cached_tokens: int

"""What a client gets from a request, made in one place per request (vLLM's output processor).

Model: after each step, every request that got a token (or ended) has its text extended by the
incremental detokenizer, which also finds stop strings (only once `min_tokens` are out). Its
`OutputKind` then decides what leaves the engine: CUMULATIVE, everything so far; FINAL_ONLY,
nothing until the request ends; DELTA, only the tokens, logprobs and text that are new, with a
tail of text held back while it could still be the start of a stop string (a stop string is
never half-sent). Prompt logprobs leave with the first output of a DELTA request (its prompt has
been computed by then) and with the final output otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serve.core.detokenizer import IncrementalDetokenizer
from serve.core.request import Request
from serve.core.sampling_params import OutputKind

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class RequestOutput:
    """One output of a request; under DELTA, `token_ids`, `logprobs` and `text` are what is new
    since the previous output, otherwise all of them so far."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    """Tokens generated so far, whatever the kind."""

    def merge(self, later: RequestOutput) -> RequestOutput:
        """This DELTA output followed by `later`, as one (a reader that fell behind)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            finished=later.finished,
            finish_reason=later.finish_reason,
            logprobs=self.logprobs + later.logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            num_cached_tokens=later.num_cached_tokens,
            num_output_tokens=later.num_output_tokens,
        )


class RequestState:
    """One request's detokenizer and what of its output has been sent."""

    def __init__(self, request: Request, tokenizer: PreTrainedTokenizerBase) -> None:
        params = request.sampling_params
        self.request = request
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            params.stop,
            include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        self.kind = params.output_kind
        self.sent_tokens = self.sent_text = 0
        self.sent_prompt_logprobs = False

    def detokenize(self) -> bool:
        """Extend the text with the request's new tokens; True when a stop string ends it."""
        request = self.request
        search = len(request.output_token_ids) >= request.sampling_params.min_tokens
        self.detokenizer.update(request.output_token_ids, request.is_finished, search)
        return self.detokenizer.stopped

    def output(self) -> RequestOutput | None:
        """What leaves the engine now (None: nothing, for a FINAL_ONLY request not done)."""
        request, finished = self.request, self.request.is_finished
        if self.kind is OutputKind.FINAL_ONLY and not finished:
            return None
        text = self.detokenizer.text
        token_ids, logprobs = request.output_token_ids, request.logprobs
        prompt_logprobs = request.prompt_logprobs if finished else []
        if self.kind is OutputKind.DELTA:
            hold = max(0, self.detokenizer.longest_stop - 1)  # a stop string's start, held back
            upto = len(text) if finished else max(self.sent_text, len(text) - hold)
            text, self.sent_text = text[self.sent_text : upto], upto
            token_ids, logprobs = token_ids[self.sent_tokens :], logprobs[self.sent_tokens :]
            self.sent_tokens = len(request.output_token_ids)
            prompt_logprobs = [] if self.sent_prompt_logprobs else request.prompt_logprobs
            self.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(token_ids),
            text=text,
            finished=finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            logprobs=list(logprobs),
            prompt_logprobs=list(prompt_logprobs),
            num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_token_ids),
        )

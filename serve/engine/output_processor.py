"""What a client gets from a request, made in one place (vLLM's output processor).

Model: the processor owns every request's client-side state, built from the core's outputs
alone (it never writes a core `Request`). After each step, every request that got a token (or
ended) has its text extended by the incremental detokenizer, which also finds stop strings (only
once `min_tokens` are out): a stop string ends the request here and comes back as an abort for
the core. Its `OutputKind` then decides what leaves the engine: CUMULATIVE, everything so far;
FINAL_ONLY, nothing until the request ends; DELTA, only the tokens, logprobs and text that are
new, with a tail of text held back while it could still be the start of a stop string (a stop
string is never half-sent). Prompt logprobs leave with the first output of a DELTA request (its
prompt has been computed by then) and with the final output otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serve.core.detokenizer import IncrementalDetokenizer
from serve.core.request import FinishReason
from serve.core.sampling_params import OutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from serve.engine.core_output import CoreOutput


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
    """One request as its client sees it: tokens, text, how it ended, and what has been sent."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self.request_id, self.prompt_token_ids, self.params = request_id, prompt_token_ids, params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            params.stop,
            include_stop=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] = []
        self.finish_reason: FinishReason | None = None
        self.num_cached_tokens = 0
        self.sent_tokens = self.sent_text = 0
        self.sent_prompt_logprobs = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: CoreOutput) -> bool:
        """Take one step's output; True when a stop string ends the request here."""
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = out.num_cached_tokens
        self.finish_reason = out.finish_reason
        search = len(self.token_ids) >= self.params.min_tokens
        self.detokenizer.update(self.token_ids, self.finished, search)
        stopped = self.detokenizer.stopped and self.finish_reason is not FinishReason.STOP
        if stopped:  # a stop string outranks a length limit reached in the same step, as in vLLM
            self.finish_reason = FinishReason.STOP
        return stopped and out.finish_reason is None

    def output(self) -> RequestOutput | None:
        """What leaves the engine now (None: nothing, for a FINAL_ONLY request not done)."""
        finished, kind = self.finished, self.params.output_kind
        if kind is OutputKind.FINAL_ONLY and not finished:
            return None
        text = self.detokenizer.text
        token_ids, logprobs = self.token_ids, self.logprobs
        prompt_logprobs = self.prompt_logprobs if finished else []
        if kind is OutputKind.DELTA:
            hold = max(0, self.detokenizer.longest_stop - 1)  # a stop string's start, held back
            upto = len(text) if finished else max(self.sent_text, len(text) - hold)
            text, self.sent_text = text[self.sent_text : upto], upto
            token_ids, logprobs = token_ids[self.sent_tokens :], logprobs[self.sent_tokens :]
            self.sent_tokens = len(self.token_ids)
            prompt_logprobs = [] if self.sent_prompt_logprobs else self.prompt_logprobs
            self.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=list(token_ids),
            text=text,
            finished=finished,
            finish_reason=self.finish_reason.value if self.finish_reason else None,
            logprobs=list(logprobs),
            prompt_logprobs=list(prompt_logprobs),
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=len(self.token_ids),
        )


class OutputProcessor:
    """Every request's `RequestState`, from `add` until its final output (or `abort`)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.progress: dict[str, int] = {}
        """Output tokens of every request that got one (or ended) in the last step."""

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.states[request_id] = RequestState(request_id, prompt_token_ids, params, self.tokenizer)

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The client outputs of one step's core outputs, and the requests a stop string ended
        (to abort in the core)."""
        results, stopped = [], []
        self.progress = {}
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:  # aborted since the step was scheduled
                continue
            if state.apply(out):
                stopped.append(out.request_id)
            self.progress[out.request_id] = len(state.token_ids)
            if (result := state.output()) is not None:
                results.append(result)
            if state.finished:
                del self.states[out.request_id]
        return results, stopped

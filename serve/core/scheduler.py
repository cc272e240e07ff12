"""Continuous batching: which requests compute how many tokens this step.

Model, one step:
  1. Running requests first, oldest first: each gets `num_tokens - num_computed_tokens` tokens
     (1 when decoding, the rest of its prompt when prefilling), cut to the remaining token budget.
     When the pool has too few free blocks, the newest running request is preempted (its blocks
     freed, its counter reset, put back at the head of the waiting queue) until the request fits or
     is itself the one preempted.
  2. If nothing was preempted, waiting requests are admitted in order while the token budget,
     `max_num_seqs` and free blocks allow, each first adopting its prefix-cache hits.
  3. `update` applies the step's sampled tokens: counters advance, stop conditions end requests,
     and finished requests free their blocks at once.
The scheduler sees token ids and block ids only; `SchedulerOutput` is all the runner gets.

Async scheduling (one step of lag): `advance` applies a step's counters as soon as it is
scheduled, each sampling request holding an output placeholder, so the next step is scheduled
while this one runs; a placeholder is scheduled as the last token of a decode chunk
(`ScheduledChunk.placeholder`: the runner writes the in-flight sample there). `update(...,
advanced=True)` later fills the placeholder and checks stops one step late: a request that
stopped then had one more token computed, which is dropped. A request whose placeholder
certainly ends it (max_tokens, max_model_len) is not scheduled again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serve.core.block_pool import BlockPool
from serve.core.config import SchedulerConfig, with_model_limit
from serve.core.kv_cache_manager import KVCacheManager
from serve.core.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: compute `token_ids` at positions `start_pos...`."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool
    """True when this chunk reaches the request's last token: the runner samples the next one."""
    adapter_id: int | None = None
    prompt_logprobs: bool = False
    """Compute logits at the chunk's rows from `first_logprob_row` on (the request asked for
    prompt logprobs)."""
    first_logprob_row: int = 0
    placeholder: bool = False
    """Its last token is the sample of the step still in flight (async scheduling): the runner
    writes that token in before computing (`token_ids` holds 0 there)."""


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_loras: int | None = None,
    ) -> None:
        self.config = with_model_limit(config, None)  # the engine resolves it against the model
        assert self.config.max_model_len is not None  # resolved just above
        self.max_model_len: int = self.config.max_model_len
        self.max_loras = max_loras
        """Most distinct adapters in one step (None: adapters are not served)."""
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        for request in list(self.running):
            if budget == 0 or request in preempted:
                break
            if self._ends_in_flight(request):
                continue
            num_new = min(self._num_pending(request), budget)
            while not self.kv.allocate_slots(request, num_new):
                preempted.append(self._preempt_newest())
                if preempted[-1] is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
        while self.waiting and budget > 0 and not preempted and self._can_admit(self.waiting[0]):
            admitted = self._admit(self.waiting[0], budget)
            if admitted is None:
                break
            scheduled.append((self.waiting.popleft(), admitted))
            budget -= admitted
        return SchedulerOutput(
            [self._chunk(r, n) for r, n in scheduled], [r.request_id for r in preempted]
        )

    @staticmethod
    def _num_pending(request: Request) -> int:
        """Tokens to compute: known ones and the placeholder of a step in flight."""
        known = request.num_tokens + request.num_output_placeholders
        return known - request.num_computed_tokens

    def _ends_in_flight(self, request: Request) -> bool:
        """The step in flight samples this request's last token (by length): nothing to do."""
        if not request.num_output_placeholders:
            return False
        outputs = len(request.output_token_ids) + request.num_output_placeholders
        total = request.num_tokens + request.num_output_placeholders
        return outputs >= request.sampling_params.max_tokens or total >= self.max_model_len

    def _can_admit(self, request: Request) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        if request.adapter_id is None or self.max_loras is None:
            return True
        adapters = {r.adapter_id for r in self.running if r.adapter_id is not None}
        return request.adapter_id in adapters or len(adapters) < self.max_loras

    def _admit(self, request: Request, budget: int) -> int | None:
        """Adopt prefix hits and allocate for the first chunk; None if blocks are short."""
        hits = self.kv.get_computed_blocks(request)
        params = request.sampling_params
        if params.prompt_logprobs is not None:  # position p - 1's logits score token p
            hits = hits[: max(params.prompt_logprobs_from - 1, 0) // self.kv.block_size]
        num_hit = len(hits) * self.kv.block_size
        num_new = min(request.num_tokens + request.num_output_placeholders - num_hit, budget)
        if not self.kv.allocate_slots(request, num_new, hits):
            return None
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return num_new

    def _preempt_newest(self) -> Request:
        victim = self.running.pop()
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        params = request.sampling_params
        first = max(params.prompt_logprobs_from - 1 - start, 0)
        token_ids = request.all_token_ids[start : start + num_new]
        placeholder = len(token_ids) < num_new  # the sample in flight: one token at the end
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids + [0] * (num_new - len(token_ids)),
            start_pos=start,
            block_ids=self.kv.block_ids(request.request_id),
            sample=start + num_new == request.num_tokens + request.num_output_placeholders,
            adapter_id=request.adapter_id,
            prompt_logprobs=params.prompt_logprobs is not None
            and start < request.num_prompt_tokens
            and first < num_new,
            first_logprob_row=first,
            placeholder=placeholder,
        )

    def advance(self, output: SchedulerOutput) -> None:
        """Async scheduling: apply a just-scheduled step's counters now, a placeholder for each
        token it samples, so that the next step can be scheduled while it runs."""
        for chunk in output.chunks:
            request = self.requests[chunk.request_id]
            request.num_computed_tokens += len(chunk.token_ids)
            if chunk.sample and request.sampling_params.max_tokens > 0:
                request.num_output_placeholders += 1

    def update(
        self, output: SchedulerOutput, sampled: dict[str, int], advanced: bool = False
    ) -> list[Request]:
        """Advance counters (unless `advance` did), append sampled tokens, finish what stops;
        return finished ones. Chunks of requests that ended since the step was scheduled (an
        abort, a stop found one step late) are dropped."""
        finished = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None:
                continue
            computed = chunk.start_pos + len(chunk.token_ids)
            if not advanced:
                request.num_computed_tokens = computed
            if request.status is RequestStatus.RUNNING:  # not preempted since
                self.kv.cache_full_blocks(request, min(computed, request.num_tokens))
            token = sampled.get(chunk.request_id)
            if advanced and token is not None:
                request.num_output_placeholders -= 1
            if token is None:
                if chunk.sample and request.sampling_params.max_tokens == 0:
                    finished.append(self.finish(request.request_id, FinishReason.LENGTH))
                continue
            request.append_output(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                finished.append(self.finish(request.request_id, reason))
        return finished  # type: ignore[return-value]

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        params = request.sampling_params
        if len(request.output_token_ids) >= params.min_tokens:
            if token in params.stop_token_ids:
                return FinishReason.STOP
            if token in request.eos_token_ids and not params.ignore_eos:
                return FinishReason.STOP
        if len(request.output_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request (stopped, at its length, or aborted) and free its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return request

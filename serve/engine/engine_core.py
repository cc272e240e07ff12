"""The engine core: one step = schedule, execute, sample, update; it knows tokens, not text.

Model: `add` queues a checked `Request`; each `step()` asks the scheduler what to compute, the
runner computes it, `StepSampling` picks the next token of every request whose chunk reached its
end, and the scheduler applies the tokens (stop on eos, stop ids, max_tokens, max_model_len).
`step` returns one `CoreOutput` per request that got a token or finished: the token, its
logprobs, and how the request ended. Only the core writes a `Request`; a stop string found in the
text (the output processor's business) comes back as `abort(request_id, FinishReason.STOP)`.
With async scheduling (`overlap.py`) `step` returns the outputs of the step before.

NOTE: a step that fails between scheduling and sampling (the model, an adapter, the sampler)
ends only the requests it scheduled: they are aborted, their blocks freed, and `StepFailed`
names them; every other request is untouched and the next step runs as usual.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import Future

from serve.core.config import CacheConfig, SchedulerConfig
from serve.core.request import FinishReason, Request
from serve.core.scheduler import Scheduler, SchedulerOutput
from serve.core.stats import EngineStats
from serve.engine.core_output import CoreOutput
from serve.engine.errors import InvalidRequest, StepFailed
from serve.engine.overlap import OverlappedSteps, StepResult
from serve.engine.step_sampling import StepSampling
from serve.lora.adapter import Adapter
from serve.lora.registry import AdapterRegistry
from serve.model.grammar import GrammarBackend, GrammarError
from serve.model.model_runner import ModelRunner


class _Clock:
    """Adds the time since the previous lap to `totals[name]`."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals, self.last = totals, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.totals[name] += now - self.last
        self.last = now


class EngineCore:
    def __init__(
        self,
        runner: ModelRunner,
        cache: CacheConfig,
        scheduler: SchedulerConfig,
        grammars: GrammarBackend,
        eos_token_ids: frozenset[int],
        adapters: AdapterRegistry[Adapter] | None = None,
        seed: int = 0,
    ) -> None:
        """`scheduler`: resolved (`max_model_len` set); `runner`: built on `adapters`."""
        self.runner, self.adapters = runner, adapters
        max_loras = self.adapters.config.max_loras if self.adapters else None
        self.scheduler = Scheduler(scheduler, runner.num_blocks, cache.block_size, max_loras)
        self.grammars = grammars
        self.sampling = StepSampling(self.scheduler, grammars, eos_token_ids, seed)
        self._overlap = OverlappedSteps(self) if scheduler.async_scheduling else None
        """Async scheduling's step in flight and its worker; None: steps run one by one."""
        self.timings: dict[str, float] = defaultdict(float)
        self.last_step_tokens = 0

    def add(self, request: Request) -> None:
        """Queue `request` (checked beforehand); its grammar, if any, becomes a matcher."""
        if request.request_id in self.scheduler.requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already in use")
        adapter_id = request.adapter_id
        if adapter_id is not None and (
            self.adapters is None or adapter_id not in self.adapters.versions
        ):
            raise InvalidRequest(f"adapter version {adapter_id} is not loaded")
        params = request.sampling_params
        if params.grammar is not None:
            try:  # deferrable exactly when the sampler takes the row's masked argmax
                self.grammars.add(request.request_id, params.grammar, params.masked_argmax)
            except GrammarError as e:
                raise InvalidRequest(str(e)) from e
        if adapter_id is not None and self.adapters is not None:
            self.adapters.acquire(adapter_id)
        self.scheduler.add_request(request)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a request wherever it is; its blocks are free when this returns."""
        request = self.scheduler.finish(request_id, reason)
        if request is None:
            self.sampling.release(request_id)  # a grammar matcher made before a refused add
            return False
        self._left(request)
        return True

    def _left(self, request: Request) -> None:
        """A request has left the scheduler: drop what else the core keeps for it."""
        self.sampling.release(request.request_id)
        if request.adapter_id is not None and self.adapters is not None:
            self.adapters.release(request.adapter_id)

    def has_unfinished(self) -> bool:
        in_flight = self._overlap is not None and self._overlap.in_flight is not None
        return self.scheduler.has_unfinished() or in_flight

    def step(self) -> list[CoreOutput]:
        """One step; with async scheduling, the outputs of the step before it."""
        return self._overlap.step() if self._overlap is not None else self.step_sync()

    def step_sync(self) -> list[CoreOutput]:
        """Schedule, compute and apply one step (nothing may be in flight)."""
        clock = _Clock(self.timings)
        out = self.scheduler.schedule()
        clock.lap("schedule")
        try:
            tokens = self._compute(out, clock)
        except Exception as e:
            raise self._fail(out, e) from e
        requests = {c.request_id: self.scheduler.requests[c.request_id] for c in out.chunks}
        finished = self.scheduler.update(out, tokens)
        outputs = self._outputs(requests, tokens, finished)
        clock.lap("update")
        self.last_step_tokens = out.num_tokens
        return outputs

    def _compute(self, out: SchedulerOutput, clock: _Clock) -> dict[str, int]:
        """Run the model over the scheduled chunks and sample: {request id: next token}.
        Grammar masks are computed beside the model's forward."""
        masks = self.grammars.start_masks([c.request_id for c in out.chunks if c.sample])
        inputs, logits = self.runner.execute(out)
        clock.lap("model")
        sampling = self.sampling
        tokens = sampling.sample(inputs, logits, masks.result() if masks is not None else None)
        sampling.record_prompt_logprobs(out, inputs, logits)
        clock.lap("sample")
        return tokens

    def _fail(self, out: SchedulerOutput, cause: Exception) -> StepFailed:
        """Abort the step's requests (freeing their blocks); device slots are rewritten later."""
        ids = [c.request_id for c in out.chunks]
        for request_id in ids:
            self.abort(request_id)
        if self.runner.lora_slots is not None:
            self.runner.lora_slots.forget_slots()
        return StepFailed(ids, cause)

    def land(self, out: SchedulerOutput, result: Future[StepResult]) -> list[CoreOutput]:
        """Apply a step computed on async scheduling's worker: its tokens, one step late (the
        chunks of requests that ended since are dropped); its failure as `StepFailed`."""
        try:
            sampled = result.result()
        except Exception as e:
            raise self._fail(out, e) from e
        requests = {
            c.request_id: r for c in out.chunks if (r := self.scheduler.requests.get(c.request_id))
        }
        tokens = {r: s.token_id for r, s in sampled.items() if r in requests}
        for request_id in tokens:
            if (logprobs := sampled[request_id].logprobs) is not None:
                requests[request_id].logprobs.append(logprobs)
        finished = self.scheduler.update(out, tokens, advanced=True)
        return self._outputs(requests, tokens, finished)

    def _outputs(
        self, requests: dict[str, Request], tokens: dict[str, int], finished: list[Request]
    ) -> list[CoreOutput]:
        for request in finished:
            self._left(request)
        done = {r.request_id for r in finished}
        outputs = []
        for request_id, request in requests.items():
            if request_id not in tokens and request_id not in done:
                continue
            new = [tokens[request_id]] if request_id in tokens else []
            wants_logprobs = request.sampling_params.logprobs is not None
            first = len(request.output_token_ids) == len(new)
            prompt_logprobs = request.prompt_logprobs if first or request.is_finished else None
            outputs.append(
                CoreOutput(
                    request_id,
                    new,
                    request.logprobs[-1:] if new and wants_logprobs else [],
                    list(prompt_logprobs) if prompt_logprobs else None,
                    request.finish_reason,
                    request.num_cached_tokens,
                )
            )
        return outputs

    def stats(self) -> EngineStats:
        graphs = self.runner.graphs
        paths = graphs.graphs.paths() if graphs is not None else ()
        return EngineStats.snapshot(self.scheduler, self.last_step_tokens, paths)

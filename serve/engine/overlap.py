"""Async scheduling: step N+1 is scheduled while step N computes.

Model: the model half of a step (flatten the chunks, run the model, sample) runs on one worker
thread, in submission order, as kernels run on one CUDA stream; the engine thread schedules.
`OverlappedSteps.step`:
  1. schedule step N+1 and `advance` its counters at once, sampling requests holding a
     placeholder for the token step N is still sampling;
  2. submit N+1 to the worker, which starts it once N is done, first writing N's sampled tokens
     into N+1's placeholder rows;
  3. wait for N's tokens and apply them (`update(..., advanced=True)`): stops are found one step
     late, so a request that stopped at N had one more token computed at N+1, which is dropped.
Steps whose requests need their previous token on the host to sample (a grammar, penalties,
min_tokens, logit bias, prompt logprobs) and engines serving LoRA adapters (whose slots the
engine thread writes between steps) run synchronously: the step in flight lands first.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from serve.core.request import Request
from serve.core.scheduler import Scheduler, SchedulerOutput
from serve.model.sampler import Sampled, SampleInput, select_rows

if TYPE_CHECKING:
    from serve.engine.core_output import CoreOutput
    from serve.engine.step_sampling import StepSampling
    from serve.model.model_runner import ModelRunner

StepResult = dict[str, Sampled]
"""What a step sampled: request id -> its token (and logprobs)."""


class SteppedEngine(Protocol):
    """What the overlapped steps need of their engine (`serve.engine.engine_core.EngineCore`)."""

    runner: ModelRunner
    scheduler: Scheduler
    sampling: StepSampling
    adapters: Any
    last_step_tokens: int

    def step_sync(self) -> list[CoreOutput]: ...

    def land(self, out: SchedulerOutput, result: Future[StepResult]) -> list[CoreOutput]: ...


def with_samples(out: SchedulerOutput, sampled: StepResult) -> SchedulerOutput:
    """`out` with each placeholder chunk's last token set to what the previous step sampled."""
    if not any(c.placeholder for c in out.chunks):
        return out
    chunks = [
        replace(c, token_ids=[*c.token_ids[:-1], sampled[c.request_id].token_id], placeholder=False)
        if c.placeholder
        else c
        for c in out.chunks
    ]
    return replace(out, chunks=chunks)


def overlappable(request: Request) -> bool:
    """A request whose next token can be sampled without its previous one on the host."""
    params = request.sampling_params
    return not params.changes_logits and params.prompt_logprobs is None


@dataclass(frozen=True)
class InFlight:
    out: SchedulerOutput
    result: Future[StepResult]


class OverlappedSteps:
    """One engine's steps with a step of lag (`EngineCore.step` when async scheduling is on)."""

    def __init__(self, engine: SteppedEngine) -> None:
        self.engine = engine
        device = engine.runner.device
        # the worker computes on the engine's device (a thread's current CUDA device is its own)
        start = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self.worker = ThreadPoolExecutor(1, "workbench-step", initializer=start)
        self.in_flight: InFlight | None = None

    def step(self) -> list[CoreOutput]:
        engine = self.engine
        if engine.adapters is not None or not all(
            map(overlappable, engine.scheduler.requests.values())
        ):
            return self.drain() if self.in_flight else engine.step_sync()
        out = engine.scheduler.schedule()
        engine.scheduler.advance(out)
        previous = self.in_flight
        self.in_flight = InFlight(out, self._submit(out, previous)) if out.chunks else None
        engine.last_step_tokens = out.num_tokens
        return engine.land(previous.out, previous.result) if previous else []

    def drain(self) -> list[CoreOutput]:
        """Apply the step in flight, if any; nothing is in flight afterwards."""
        previous, self.in_flight = self.in_flight, None
        return self.engine.land(previous.out, previous.result) if previous else []

    def _submit(self, out: SchedulerOutput, previous: InFlight | None) -> Future[StepResult]:
        engine, sampling = self.engine, self.engine.sampling
        inputs = {
            c.request_id: sampling.sample_input(engine.scheduler.requests[c.request_id])
            for c in out.chunks
            if c.sample and sampling.wants_token(c.request_id)
        }
        before = previous.result if previous else None
        return self.worker.submit(self._compute, out, inputs, before)

    def _compute(
        self,
        out: SchedulerOutput,
        inputs: dict[str, SampleInput],
        before: Future[StepResult] | None,
    ) -> StepResult:
        """On the worker: step N + 1 once step N (`before`) is done, its samples written in."""
        if before is not None:
            try:
                out = with_samples(out, before.result())
            except Exception:  # the step before failed: this one lands as failed too
                raise RuntimeError("the step before this one failed") from None
        step_inputs, logits = self.engine.runner.execute(out)
        ids = [r for r in step_inputs.sample_rows if r in inputs]
        if not ids:
            return {}
        rows = select_rows(logits, [step_inputs.sample_rows[r] for r in ids])
        sampled = self.engine.sampling.sampler.sample(rows, [inputs[r] for r in ids])
        return dict(zip(ids, sampled))

    def close(self) -> None:
        self.worker.shutdown(wait=True)

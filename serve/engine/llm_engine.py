"""The engine: one step = schedule, execute, sample, update.

Model: `add_request` validates and queues a request; each `step()` asks the scheduler what to
compute, the runner computes it, the sampler picks the next token of every request whose chunk
reached its end, and the scheduler applies the tokens (stop on eos, stop ids, max_tokens,
max_model_len). Each request's `RequestState` (`output_processor`) detokenizes, finds stop strings
and decides what leaves: `step` returns one `RequestOutput` per request that produced a token or
finished (a FINAL_ONLY request only when it finishes); `progress` says how many tokens each
request has after the step, whatever was returned.

NOTE: a step that fails between scheduling and sampling (the model, an adapter, the sampler)
ends only the requests it scheduled: they are aborted, their blocks freed, and `StepFailed`
names them; every other request is untouched and the next step runs as usual.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig, with_model_limit
from serve.core.kv_cache_manager import cdiv
from serve.core.request import FinishReason, Request
from serve.core.sampling_params import SamplingParams
from serve.core.scheduler import Scheduler, SchedulerOutput
from serve.core.stats import EngineStats
from serve.engine.generation_defaults import GenerationDefaults
from serve.engine.loader import load_for_serving
from serve.engine.output_processor import RequestOutput, RequestState
from serve.engine.overlap import OverlappedSteps, StepResult
from serve.lora.adapter import Adapter
from serve.lora.manager import LoraConfig
from serve.model.grammar import Bitmasks, GrammarBackend, GrammarError
from serve.model.model_runner import ModelRunner, RunnerOptions, position_limit
from serve.model.sampler import SampleInput, Sampler, logprobs_of, select_rows
from serve.model.step_inputs import StepInputs

__all__ = ["InvalidRequest", "LLMEngine", "RequestOutput", "StepFailed"]


class _Clock:
    """Adds the time since the previous lap to `totals[name]`."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals, self.last = totals, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.totals[name] += now - self.last
        self.last = now


class InvalidRequest(ValueError):
    """A request the engine refuses at `add_request`; the message names the limit."""


class StepFailed(RuntimeError):
    """One step failed; the requests it had scheduled are aborted (blocks freed), no others."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"a step of {len(request_ids)} request(s) failed: {cause!r}")
        self.request_ids, self.cause = request_ids, cause


class LLMEngine:
    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        seed: int = 0,
        loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase] | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        self.cache_config = cache = cache or CacheConfig()
        ready = load_for_serving(model, loaded, lora is not None)
        hf_model, self.tokenizer, self.vocab_size = ready.model, ready.tokenizer, ready.vocab_size
        self.scheduler_config = scheduler = with_model_limit(
            scheduler or SchedulerConfig(), position_limit(hf_model)
        )
        graphs = not (model.enforce_eager or model.compile)
        options = RunnerOptions(model.attention_backend, model.compile, lora, graphs)
        self.runner = ModelRunner(hf_model, cache, scheduler, ready.device, options)
        self.adapters = self.runner.adapters
        max_loras = lora.max_loras if lora else None
        self.scheduler = Scheduler(scheduler, self.runner.num_blocks, cache.block_size, max_loras)
        self.sampler = Sampler(seed)
        defaults = GenerationDefaults.read(hf_model, self.tokenizer, model.generation_config)
        self.eos_token_ids = defaults.eos_token_ids
        self.sampling_defaults = defaults.sampling
        self.grammars = GrammarBackend(
            self.tokenizer,
            self.vocab_size,
            sorted(self.eos_token_ids),
            overlap=self.runner.device.type != "cpu",
        )
        self._overlap = OverlappedSteps(self) if scheduler.async_scheduling else None
        """Async scheduling's step in flight and its worker; None: steps run one by one."""
        self._states: dict[str, RequestState] = {}
        self.progress: dict[str, int] = {}
        """Output tokens of every request that got one in the last step."""
        self.timings: dict[str, float] = defaultdict(float)
        self.last_step_tokens = 0

    @property
    def max_model_len(self) -> int:
        assert self.scheduler_config.max_model_len is not None  # resolved in __init__
        return self.scheduler_config.max_model_len

    @property
    def kv_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.runner.num_blocks * self.cache_config.block_size

    @property
    def context_limit(self) -> int:
        """Most tokens one request can hold: max_model_len, or less when the KV cache is smaller."""
        return min(self.max_model_len, self.kv_tokens)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        adapter_id: int | None = None,
    ) -> Request:
        token_ids = self.tokenize(prompt)
        self._validate(request_id, token_ids, params, adapter_id)
        request = Request(
            request_id,
            token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            adapter_id=adapter_id,
        )
        if params.grammar is not None:
            try:
                # deferrable exactly when the sampler takes the row's masked argmax
                self.grammars.add(request_id, params.grammar, params.masked_argmax)
            except GrammarError as e:
                raise InvalidRequest(str(e)) from e
        self.scheduler.add_request(request)
        self._states[request_id] = RequestState(request, self.tokenizer)
        return request

    def _validate(
        self, request_id: str, token_ids: list[int], params: SamplingParams, adapter_id: int | None
    ) -> None:
        limit, capacity = self.max_model_len, self.kv_tokens
        if request_id in self.scheduler.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if adapter_id is not None and (
            self.adapters is None or adapter_id not in self.adapters.versions
        ):
            raise InvalidRequest(f"adapter version {adapter_id} is not loaded")
        if not token_ids:
            raise InvalidRequest("the prompt is empty; give at least one token")
        if bad := [t for t in token_ids if not 0 <= t < self.vocab_size]:
            raise InvalidRequest(
                f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        named = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
        if bad := [t for t in named if not 0 <= t < self.vocab_size]:
            raise InvalidRequest(
                f"logit_bias / stop_token_ids name token ids {bad[:5]} outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        total = len(token_ids) + params.max_tokens
        if total > limit:
            raise InvalidRequest(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len ({limit}); shorten the prompt or lower max_tokens"
            )
        if cdiv(total, self.cache_config.block_size) > self.runner.num_blocks:
            raise InvalidRequest(
                f"prompt + max_tokens = {total} tokens exceeds the KV cache ({capacity} tokens); "
                "give the engine more KV memory or lower max_tokens"
            )

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is; its blocks are free when this returns."""
        self._forget(request_id)
        return self.scheduler.finish(request_id, FinishReason.ABORT) is not None

    def _forget(self, request_id: str) -> None:
        """Drop what the engine keeps per request beside the scheduler: output state,
        generator and grammar matcher."""
        self._states.pop(request_id, None)
        self.sampler.release(request_id)
        self.grammars.release(request_id)

    def has_unfinished_requests(self) -> bool:
        in_flight = self._overlap is not None and self._overlap.in_flight is not None
        return self.scheduler.has_unfinished() or in_flight

    def step(self) -> list[RequestOutput]:
        """One step; with async scheduling, the outputs of the step before it."""
        return self._overlap.step() if self._overlap is not None else self.step_sync()

    def step_sync(self) -> list[RequestOutput]:
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
        if finished and self.adapters is not None:
            self.adapters.release(self.adapters_in_use())
        clock.lap("update")
        self.last_step_tokens = out.num_tokens
        return outputs

    def _compute(self, out: SchedulerOutput, clock: _Clock) -> dict[str, int]:
        """Run the model over the scheduled chunks and sample: {request id: next token}.
        Grammar masks are computed beside the model's forward."""
        masks = self.grammars.start_masks([c.request_id for c in out.chunks if c.sample])
        inputs, logits = self.runner.execute(out)
        clock.lap("model")
        tokens = self._sample(inputs, logits, masks.result() if masks is not None else None)
        self._record_prompt_logprobs(out, inputs, logits)
        clock.lap("sample")
        return tokens

    def _fail(self, out: SchedulerOutput, cause: Exception) -> StepFailed:
        """Abort the step's requests (freeing their blocks); device slots are rewritten later."""
        ids = [c.request_id for c in out.chunks]
        for request_id in ids:
            self.abort(request_id)
        if self.adapters is not None:
            self.adapters.forget_slots()
        return StepFailed(ids, cause)

    def _sample(
        self, inputs: StepInputs, logits: torch.Tensor, masks: Bitmasks | None
    ) -> dict[str, int]:
        """Sample for every request whose chunk reached its end and that wants a token."""
        ids = [r for r in inputs.sample_rows if self.wants_token(r)]
        if not ids:
            return {}
        requests = [self.scheduler.requests[r] for r in ids]
        rows = [inputs.sample_rows[r] for r in ids]
        sample_inputs = [self.sample_input(r) for r in requests]
        allowed = masks.aligned(ids) if masks is not None else None
        sampled = self.sampler.sample(select_rows(logits, rows), sample_inputs, allowed)
        tokens = {r: s.token_id for r, s in zip(ids, sampled)}
        if rejected := self.grammars.consume(tokens):
            # deferred masks whose free argmax the grammar rejected: the masked argmax now
            position = {r: k for k, r in enumerate(ids)}
            again = [position[r] for r in rejected]
            redrawn = self.sampler.sample(
                select_rows(logits, [rows[k] for k in again]),
                [sample_inputs[k] for k in again],
                self.grammars.masks_now(rejected).words,
            )
            for k, s in zip(again, redrawn):
                sampled[k] = s
                tokens[ids[k]] = s.token_id
            self.grammars.consume({r: tokens[r] for r in rejected})
        for request, s in zip(requests, sampled):
            if s.logprobs is not None:
                request.logprobs.append(s.logprobs)
        return tokens

    def sample_input(self, request: Request) -> SampleInput:
        params = request.sampling_params
        constrained = request.request_id in self.grammars.matchers
        if not params.processes_row:  # at most a grammar's mask, read from the step's bitmasks
            generator = self.sampler.generator_for(request.request_id, params.seed)
            return SampleInput(params, generator, constrained=constrained)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        return SampleInput(
            params,
            self.sampler.generator_for(request.request_id, params.seed),
            request.prompt_token_ids,
            request.output_token_ids,
            stop_ids,
            constrained,
        )

    def _record_prompt_logprobs(
        self, out: SchedulerOutput, inputs: StepInputs, logits: torch.Tensor
    ) -> None:
        """Logits at position p score prompt token p + 1; token 0, and those before
        `prompt_logprobs_from`, get None."""
        for chunk in out.chunks:
            if chunk.request_id not in inputs.prompt_rows:
                continue
            request = self.scheduler.requests[chunk.request_id]
            first, count = inputs.prompt_rows[chunk.request_id]
            top_n = request.sampling_params.prompt_logprobs or 0
            if not request.prompt_logprobs:
                skipped = max(request.sampling_params.prompt_logprobs_from, 1)
                request.prompt_logprobs.extend([None] * min(skipped, request.num_prompt_tokens))
            rows: list[int] = []
            tokens: list[int] = []
            for i in range(count):
                target = chunk.start_pos + chunk.first_logprob_row + i + 1
                recorded = len(request.prompt_logprobs) + len(rows)
                if target == recorded and target < request.num_prompt_tokens:
                    rows.append(first + i)
                    tokens.append(request.prompt_token_ids[target])
            if rows:
                picked = select_rows(logits, rows)
                request.prompt_logprobs.extend(logprobs_of(picked, tokens, top_n))

    def adapters_in_use(self) -> set[int]:
        return {r.adapter_id for r in self.scheduler.requests.values() if r.adapter_id is not None}

    def load_lora(self, name: str, path: str) -> int:
        """Load (or reload: a new version) an adapter between steps; running requests keep theirs."""
        if self.adapters is None:
            raise InvalidRequest(
                "this engine was started without LoRA support (give it a LoraConfig)"
            )
        return self.adapters.load(name, Path(path), self.adapters_in_use())

    def resolve_lora(self, name: str) -> int | None:
        """The current version of adapter `name` (marked most recently used), None when it is
        not loaded or the engine has no LoRA support."""
        return self.adapters.resolve(name) if self.adapters is not None else None

    def register_lora(self, name: str, adapter: Adapter, evict: bool = False) -> int:
        """Register an adapter read beforehand (`adapters.read`): the cheap, between-steps half."""
        if self.adapters is None:
            raise InvalidRequest("this engine was started without LoRA support")
        return self.adapters.register(name, adapter, self.adapters_in_use(), evict)

    def unload_lora(self, name: str) -> int:
        if self.adapters is None:
            raise InvalidRequest("this engine was started without LoRA support")
        return self.adapters.unload(name, self.adapters_in_use())

    def wants_token(self, request_id: str) -> bool:
        return self.scheduler.requests[request_id].sampling_params.max_tokens > 0

    def land(self, out: SchedulerOutput, result: Future[StepResult]) -> list[RequestOutput]:
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
    ) -> list[RequestOutput]:
        done = {r.request_id for r in finished}
        outputs = []
        self.progress = {}
        for request_id, request in requests.items():
            if request_id not in tokens and request_id not in done:
                continue
            state = self._states[request_id]
            if state.detokenize() and request.finish_reason is not FinishReason.STOP:
                # a stop string outranks a length limit reached in the same step, as in vLLM
                if request.is_finished:
                    request.finish_reason = FinishReason.STOP
                else:
                    self.scheduler.finish(request_id, FinishReason.STOP)
            self.progress[request_id] = len(request.output_token_ids)
            if (out := state.output()) is not None:
                outputs.append(out)
            if request.is_finished:
                self._forget(request_id)
        return outputs

    def stats(self) -> EngineStats:
        graphs = self.runner.graphs
        paths = graphs.graphs.paths() if graphs is not None else ()
        return EngineStats.snapshot(self.scheduler, self.last_step_tokens, paths)

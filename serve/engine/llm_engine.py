"""The engine as its clients drive it: requests in, `RequestOutput`s out, one step at a time.

Model: `LLMEngine` puts the pieces together once (`loader.load_for_serving` resolves device,
dtype and what is done to the model; the runner sizes the KV cache; the core schedules and
samples; the output processor turns tokens into text) and is the one interface both the
offline `LLM` and the server's `AsyncEngine` use: `add_request` tokenizes, checks and queues a
request; `step` runs one core step and returns one `RequestOutput` per request that produced a
token or finished (a FINAL_ONLY request only when it finishes), ending in the core every request
a stop string ended; `progress` says how many tokens each request has after the step, whatever
was returned; `abort` ends a request wherever it is. Adapters are the registry's
(`adapters`, None without LoRA): `load_lora` reads and registers one between steps.
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig, with_model_limit
from serve.core.request import FinishReason, Request
from serve.core.sampling_params import SamplingParams
from serve.core.stats import EngineStats
from serve.engine.engine_core import EngineCore
from serve.engine.errors import InvalidRequest, StepFailed
from serve.engine.generation_defaults import GenerationDefaults
from serve.engine.loader import load_for_serving
from serve.engine.output_processor import OutputProcessor, RequestOutput
from serve.engine.request_checks import RequestLimits
from serve.lora.adapter import Adapter
from serve.lora.registry import AdapterRegistry, LoraConfig
from serve.model.grammar import GrammarBackend
from serve.model.model_runner import ModelRunner, RunnerOptions, position_limit

__all__ = ["InvalidRequest", "LLMEngine", "RequestOutput", "StepFailed"]


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
        self.adapters = AdapterRegistry[Adapter](lora) if lora is not None else None
        graphs = not (model.enforce_eager or model.compile)
        options = RunnerOptions(model.attention_backend, model.compile, self.adapters, graphs)
        self.runner = ModelRunner(hf_model, cache, scheduler, ready.device, options)
        defaults = GenerationDefaults.read(hf_model, self.tokenizer, model.generation_config)
        self.eos_token_ids = defaults.eos_token_ids
        self.sampling_defaults = defaults.sampling
        self.grammars = GrammarBackend(
            self.tokenizer,
            self.vocab_size,
            sorted(self.eos_token_ids),
            overlap=self.runner.device.type != "cpu",
        )
        self.core = EngineCore(
            self.runner, cache, scheduler, self.grammars, self.eos_token_ids, self.adapters, seed
        )
        self.scheduler, self.timings = self.core.scheduler, self.core.timings
        assert scheduler.max_model_len is not None  # resolved above
        self.limits = RequestLimits(
            self.vocab_size, scheduler.max_model_len, self.runner.num_blocks, cache.block_size
        )
        self.outputs = OutputProcessor(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def kv_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.limits.kv_tokens

    @property
    def context_limit(self) -> int:
        """Most tokens one request can hold: max_model_len, or less when the KV cache is smaller."""
        return min(self.limits.max_model_len, self.limits.kv_tokens)

    @property
    def progress(self) -> dict[str, int]:
        """Output tokens of every request that got one (or ended) in the last step."""
        return self.outputs.progress

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
        self.limits.check(token_ids, params)
        request = Request(
            request_id, token_ids, params, eos_token_ids=self.eos_token_ids, adapter_id=adapter_id
        )
        self.core.add(request)
        self.outputs.add(request_id, request.prompt_token_ids, params)
        return request

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is; its blocks are free when this returns."""
        self.outputs.abort(request_id)
        return self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One step; with async scheduling, the outputs of the step before it."""
        outputs, stopped = self.outputs.process(self.core.step())
        for request_id in stopped:
            self.core.abort(request_id, FinishReason.STOP)
        return outputs

    def load_lora(self, name: str, path: str) -> int:
        """Load (or reload: a new version) an adapter between steps; running requests keep theirs."""
        if self.adapters is None or self.runner.lora_slots is None:
            raise InvalidRequest(
                "this engine was started without LoRA support (give it a LoraConfig)"
            )
        return self.adapters.register(name, self.runner.lora_slots.read(Path(path)))

    def stats(self) -> EngineStats:
        return self.core.stats()

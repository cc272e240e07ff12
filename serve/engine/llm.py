"""The offline Python API: `LLM(model_dir).generate(prompts, params)`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.core.sampling_params import OutputKind, SamplingParams
from serve.engine.llm_engine import InvalidRequest, LLMEngine, RequestOutput
from serve.lora.registry import LoraConfig


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[dict[int, float]]
    num_cached_tokens: int
    prompt_logprobs: list[dict[int, float] | None]


class LLM:
    """Runs an engine to completion over a list of prompts (text or token ids), on the base model
    or on LoRA adapters (one per prompt if need be), as the server does.

    `model` is a model dir or hub id (with `model_options`: the other `ModelConfig` fields, e.g.
    `dtype="float32"`) or a whole `ModelConfig`; `cache`, `scheduler` and `lora` are the engine's
    configs (their defaults when None; `lora` is implied by `loras`); `loras` maps adapter names
    to PEFT adapter dirs loaded at start.
    """

    def __init__(
        self,
        model: str | Path | ModelConfig,
        *,
        cache: CacheConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        lora: LoraConfig | None = None,
        loras: dict[str, str | Path] | None = None,
        seed: int = 0,
        **model_options: Any,
    ) -> None:
        if isinstance(model, ModelConfig):
            if model_options:
                raise TypeError(f"give {sorted(model_options)} inside the ModelConfig")
            model_config = model
        else:
            model_config = ModelConfig(str(model), **model_options)
        if loras and lora is None:
            lora = LoraConfig()
        self.engine = LLMEngine(model_config, cache, scheduler, seed=seed, lora=lora)
        for name, path in (loras or {}).items():
            self.load_lora(name, path)

    def load_lora(self, name: str, path: str | Path) -> int:
        """Load (or reload) an adapter; prompts select it with `generate(..., lora=name)`."""
        return self.engine.load_lora(name, str(path))

    def _adapter_id(self, name: str | None) -> int | None:
        if name is None:
            return None
        registry = self.engine.adapters
        version = registry.resolve(name) if registry is not None else None
        if version is None:
            loaded = ", ".join(registry.current) if registry else "none"
            raise InvalidRequest(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return version

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
        progress: bool = False,
        lora: str | list[str | None] | None = None,
    ) -> list[Completion]:
        """One completion per prompt; `lora`: the adapter every prompt runs on, or one per
        prompt (None: the base model)."""
        batch: list[str | list[int]] = [prompts] if isinstance(prompts, str) else list(prompts)
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(batch)
        )
        adapters = lora if isinstance(lora, list) else [lora] * len(batch)
        if len(params_list) != len(batch) or len(adapters) != len(batch):
            raise ValueError("give one SamplingParams and one lora per prompt, or one for all")
        versions = [self._adapter_id(name) for name in adapters]
        ids = [f"gen-{i}" for i in range(len(batch))]
        for request_id, prompt, p, version in zip(ids, batch, params_list, versions):
            final = replace(p, output_kind=OutputKind.FINAL_ONLY)  # intermediate outputs unread
            self.engine.add_request(request_id, prompt, final, adapter_id=version)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not progress, desc="generating", unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update()
        return [self._completion(done[i]) for i in ids]

    @staticmethod
    def _completion(out: RequestOutput) -> Completion:
        return Completion(
            text=out.text,
            token_ids=out.token_ids,
            finish_reason=out.finish_reason or "abort",
            usage=Usage(len(out.prompt_token_ids), len(out.token_ids)),
            logprobs=out.logprobs,
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=out.prompt_logprobs,
        )

"""The offline Python API: `LLM(model_dir).generate(prompts, params)`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from serve.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.engine import LLMEngine, RequestOutput
from serve.sampling_params import SamplingParams


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
    """Runs an engine to completion over a list of prompts (text or token ids)."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "auto",
        device: str = "auto",
        attention_backend: str = "auto",
        seed: int = 0,
        block_size: int = 8,
        kv_cache_bytes: int | None = None,
        num_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 1024,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        compile: bool = False,
    ) -> None:
        self.engine = LLMEngine(
            ModelConfig(str(model), dtype, device, attention_backend, compile=compile),
            CacheConfig(block_size, kv_cache_bytes, num_blocks=num_blocks),
            SchedulerConfig(
                max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching
            ),
            seed=seed,
        )

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[Completion]:
        batch: list[str | list[int]] = [prompts] if isinstance(prompts, str) else list(prompts)
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(batch)
        )
        ids = [f"gen-{i}" for i in range(len(batch))]
        for request_id, prompt, p in zip(ids, batch, params_list):
            self.engine.add_request(request_id, prompt, p)
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

"""Greedy decoding of real models two ways, for the slow exactness tests: `generate` one prompt
at a time, and the engine on all of them at once (the pool checked after every step)."""

from __future__ import annotations

from pathlib import Path

import torch

from compress.load_model import load_model
from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig


def generate_each(
    model_dir: Path, prompts: list[list[int]], max_tokens: list[int]
) -> list[list[int]]:
    model = load_model(model_dir)
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
            )
            outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def run_engine(
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: list[int],
    num_blocks: int,
    backend: str = "auto",
    budget: int = 512,
) -> tuple[list[list[int]], int]:
    """Each prompt's output token ids, and how many preemptions the run took."""
    engine = LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cpu", attention_backend=backend),
        CacheConfig(block_size=16, num_blocks=num_blocks),
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=2048),
    )
    return greedy_outputs(engine, prompts, max_tokens), engine.stats().num_preemptions


def greedy_outputs(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]
) -> list[list[int]]:
    """Each prompt's greedy output token ids, all requests added at once; the block pool is
    checked after every step and must be all free at the end."""
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0))
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = out.token_ids
        engine.scheduler.pool.check_integrity()
    pool = engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks
    return [outputs[i] for i in range(len(prompts))]

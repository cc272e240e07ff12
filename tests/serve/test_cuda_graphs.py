"""The decode graphs, persistent buffers and async scheduling on a real GPU: CUDA graphs token-equal
to eager steps, async steps equal to steps one by one (marker `gpu`; `benchmarks/gpu.sh run`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from tests.serve.conftest import Case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
]


def engine(model_dir: Path, eager: bool = False, overlap: bool = False) -> LLMEngine:
    return LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cuda", enforce_eager=eager),
        CacheConfig(block_size=16, num_blocks=512),
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32, async_scheduling=overlap),
    )


def run(e: LLMEngine, cases: list[Case]) -> dict[str, list[int]]:
    for i, c in enumerate(cases):
        e.add_request(str(i), c.prompt, SamplingParams(max_tokens=c.max_tokens, temperature=0))
    done: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in e.step() if o.finished})
    assert e.scheduler.pool.num_free_blocks == e.scheduler.pool.num_blocks
    return done


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cuda_graph_decodes_equal_eager_steps(
    model_dirs: dict[str, Path], cases: list[Case], arch: str
) -> None:
    graphed = engine(model_dirs[arch])
    assert graphed.runner.graphs is not None, "no graphs captured on CUDA"
    assert graphed.runner.buffers.host["input_ids"].is_pinned()
    assert run(graphed, cases[:24]) == run(engine(model_dirs[arch], eager=True), cases[:24])
    paths = dict(graphed.stats().decode_paths)
    assert paths["graph"] > 0 and paths.get("eager:batch_size", 0) == 0


def test_cuda_async_scheduling_equals_steps_one_by_one(
    model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    overlapped = run(engine(model_dirs["llama"], overlap=True), cases[:24])
    assert overlapped == run(engine(model_dirs["llama"]), cases[:24])

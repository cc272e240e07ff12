"""Greedy token ids from the engine equal `transformers.generate` run per request, whatever the
engine does to get there: ample KV, repeated preemption, chunked prefill, prefix-cache hits,
requests joining mid-flight, aborts. After every run all blocks are free and the pool is sound."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.core.scheduler import SchedulerOutput
from tests.serve.conftest import PAGED_CPU, Case, make_cases, reference_outputs


def make_engine(
    model_dir: Path,
    num_blocks: int = 512,
    budget: int = 2048,
    backend: str = "auto",
    **sched: int,
) -> LLMEngine:
    return LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cpu", attention_backend=backend),
        CacheConfig(block_size=16, num_blocks=num_blocks),
        SchedulerConfig(max_num_batched_tokens=budget, **sched),
    )


def greedy(case: Case) -> SamplingParams:
    return SamplingParams(max_tokens=case.max_tokens, temperature=0)


def run(
    engine: LLMEngine,
    cases: list[Case],
    arrivals: dict[int, list[int]] | None = None,
    aborts: dict[int, list[int]] | None = None,
) -> dict[int, list[int]]:
    """Add case i at the step `arrivals` names (all at step 0 by default), abort as `aborts`
    says; run to the end; return each finished request's output token ids."""
    arrivals = arrivals or {0: list(range(len(cases)))}
    aborts = aborts or {}
    outputs: dict[int, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), cases[i].prompt, greedy(cases[i]))
        for i in aborts.get(step, []):
            engine.abort(str(i))
        for out in engine.step() if engine.has_unfinished_requests() else []:
            if out.finished:
                outputs[int(out.request_id)] = out.token_ids
        engine.scheduler.pool.check_integrity()
        step += 1
    assert_all_free(engine)
    return outputs


def assert_all_free(engine: LLMEngine) -> None:
    pool = engine.scheduler.pool
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.scheduler.kv.blocks


def assert_equal(outputs: dict[int, list[int]], reference: list[list[int]], ids: list[int]) -> None:
    mismatched = [i for i in ids if outputs[i] != reference[i]]
    if mismatched:
        first = mismatched[0]
        raise AssertionError(
            f"{mismatched} differ; {first}: {outputs[first]} vs {reference[first]}"
        )


ONE_CALL = ["flex", "padded-sdpa"]
"""The backends attending every decode in one call a layer and every prefill chunk in another
(`serve/model/flex_attention.py`, `serve/model/padded_attention.py`)."""


@pytest.mark.parametrize("backend", [PAGED_CPU, "sdpa", *ONE_CALL])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_ample_kv(
    arch: str, backend: str, model_dirs: dict[str, Path], cases: list[Case], references: dict
) -> None:
    engine = make_engine(model_dirs[arch], backend=backend)
    assert_equal(run(engine, cases), references[arch], list(range(len(cases))))
    assert engine.stats().num_preemptions == 0


def test_reference_backend_agrees(
    model_dirs: dict[str, Path], cases: list[Case], references: dict
) -> None:
    engine = make_engine(model_dirs["llama"], backend="reference", budget=256)
    assert_equal(run(engine, cases[:12]), references["llama"], list(range(12)))


@pytest.mark.parametrize("backend", [PAGED_CPU, "sdpa", *ONE_CALL])
def test_tiny_kv_pool_preempts_repeatedly(
    backend: str, model_dirs: dict[str, Path], cases: list[Case], references: dict
) -> None:
    engine = make_engine(model_dirs["llama"], num_blocks=40, backend=backend)
    outputs = run(engine, cases)
    assert engine.stats().num_preemptions >= 5
    assert_equal(outputs, references["llama"], list(range(len(cases))))


@pytest.mark.parametrize("backend", [PAGED_CPU, "sdpa", "reference", *ONE_CALL])
def test_sliding_window_with_chunked_prefill_and_preemption(
    backend: str, model_dirs: dict[str, Path], cases: list[Case], references: dict
) -> None:
    """Gemma 3's local layers (window 16) while prompts are cut into 24-token chunks that start
    inside, at and past the window, and a small pool forces recomputation."""
    engine = make_engine(model_dirs["gemma3"], num_blocks=48, budget=24, backend=backend)
    outputs = run(engine, cases)
    assert engine.stats().num_preemptions >= 2
    assert_equal(outputs, references["gemma3"], list(range(len(cases))))


def test_flex_reading_the_cache_in_place_equals_generate(
    model_dirs: dict[str, Path], cases: list[Case], references: dict
) -> None:
    """The layout flex uses on CUDA (keys read from the whole cache, blocks found through the
    tables), run eagerly here: Gemma 3's windows, chunked prefill, preemption, a small pool
    (eagerly flex scores every key of the cache)."""
    from serve.model.flex_attention import FlexAttentionBackend

    engine = make_engine(model_dirs["gemma3"], num_blocks=48, budget=24, backend="flex")
    engine.runner.backend = FlexAttentionBackend("paged")
    outputs = run(engine, cases)
    assert engine.stats().num_preemptions >= 2
    assert_equal(outputs, references["gemma3"], list(range(len(cases))))


@pytest.mark.parametrize("backend", ["auto", *ONE_CALL])
def test_small_token_budget_chunks_prefill(
    backend: str, model_dirs: dict[str, Path], cases: list[Case], references: dict
) -> None:
    engine = make_engine(model_dirs["qwen2"], budget=48, backend=backend)
    seen: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: seen.append(schedule()) or seen[-1]  # type: ignore[method-assign]
    outputs = run(engine, cases)
    assert all(out.num_tokens <= 48 for out in seen)
    partial = [c for out in seen for c in out.chunks if not c.sample and len(c.token_ids) > 1]
    assert len(partial) >= 10, "long prompts were not split into chunks"
    assert_equal(outputs, references["qwen2"], list(range(len(cases))))


@pytest.mark.parametrize("backend", ["auto", *ONE_CALL])
def test_shared_prefixes_hit_the_cache(
    backend: str, model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    shared = cases[1].prompt[:100]  # 6 full blocks
    prefixed = [Case(shared + c.prompt[:40], c.max_tokens) for c in cases[:12]]
    reference = reference_outputs(model_dirs["llama"], prefixed)
    engine = make_engine(model_dirs["llama"], backend=backend)
    outputs = run(engine, prefixed, arrivals={0: [0], 3: list(range(1, 12))})
    stats = engine.stats()
    assert stats.prefix_cache_hits == 11 * 96
    assert_equal(outputs, reference, list(range(12)))


@pytest.mark.parametrize("backend", ["auto", *ONE_CALL])
def test_full_prefix_hit_recomputes_last_block(
    backend: str, model_dirs: dict[str, Path], cases: list[Case], references: dict
) -> None:
    """A prompt of exactly 4 cached blocks reuses 3 and computes the last block again."""
    prompt = cases[1].prompt[:64]
    engine = make_engine(model_dirs["llama"], backend=backend)
    twice = [Case(prompt, 8), Case(prompt, 8)]
    outputs = run(engine, twice, arrivals={0: [0], 2: [1]})
    assert outputs[0] == outputs[1]
    assert engine.stats().prefix_cache_hits == 48


def test_requests_join_while_others_decode(
    model_dirs: dict[str, Path], cases: list[Case], references: dict
) -> None:
    engine = make_engine(model_dirs["qwen3"], budget=256)
    arrivals = {
        step: list(range(k, min(k + 4, 32))) for step, k in zip(range(0, 80, 10), range(0, 32, 4))
    }
    assert_equal(run(engine, cases, arrivals=arrivals), references["qwen3"], list(range(32)))


def test_aborts_mid_generation(
    model_dirs: dict[str, Path], cases: list[Case], references: dict
) -> None:
    engine = make_engine(model_dirs["llama"], budget=256)
    aborted = [3, 7, 11, 20, 31]
    outputs = run(engine, cases, aborts={2: aborted[:2], 6: aborted[2:]})
    survivors = [i for i in range(32) if i not in aborted]
    assert set(outputs) >= set(survivors)
    assert_equal(outputs, references["llama"], survivors)


def test_prompt_over_max_model_len_is_refused(model_dirs: dict[str, Path]) -> None:
    from serve import InvalidRequest

    engine = make_engine(model_dirs["llama"], max_model_len=128)
    with pytest.raises(InvalidRequest, match=r"exceeds max_model_len \(128\)"):
        engine.add_request("a", list(range(6, 126)), SamplingParams(max_tokens=10))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("b", [], SamplingParams())
    assert_all_free(engine)


def test_request_larger_than_the_kv_cache_is_refused(model_dirs: dict[str, Path]) -> None:
    from serve import InvalidRequest

    engine = make_engine(model_dirs["llama"], num_blocks=4)
    with pytest.raises(InvalidRequest, match=r"exceeds the KV cache \(64 tokens\)"):
        engine.add_request("a", list(range(6, 60)), SamplingParams(max_tokens=20))


def test_more_cases_mixed_lengths(model_dirs: dict[str, Path]) -> None:
    """A second seeded set, so no single prompt set decides the outcome."""
    cases = make_cases(16, seed=99, vocab=500, max_prompt=120, max_out=32)
    reference = reference_outputs(model_dirs["qwen2"], cases)
    engine = make_engine(model_dirs["qwen2"], num_blocks=24, budget=64)
    assert_equal(run(engine, cases), reference, list(range(16)))

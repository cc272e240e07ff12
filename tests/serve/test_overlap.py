"""Async scheduling (a step of lag, the model half on a worker thread): the same tokens, texts
and finish reasons as steps run one by one, under preemption, stop strings, max_tokens and
aborts; step N+1 is scheduled while step N is held computing (a gate the test controls)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from tests.serve.conftest import Case


def make_engine(model_dir: Path, overlap: bool, num_blocks: int = 256) -> LLMEngine:
    return LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cpu"),
        CacheConfig(block_size=16, num_blocks=num_blocks),
        SchedulerConfig(max_num_batched_tokens=128, async_scheduling=overlap),
    )


def run(
    engine: LLMEngine,
    requests: list[tuple[list[int], SamplingParams]],
    aborts: dict[int, list[int]] | None = None,
) -> dict[int, tuple[list[int], str, str | None]]:
    """Run every request (added at step 0), aborting as `aborts` says; the finished ones'
    (tokens, text, finish reason). Block accounting is checked after every step."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    done: dict[int, tuple[list[int], str, str | None]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for i in (aborts or {}).get(step, []):
            engine.abort(str(i))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = (out.token_ids, out.text, out.finish_reason)
        engine.scheduler.pool.check_integrity()
        step += 1
    pool = engine.scheduler.pool
    assert pool.num_free_blocks == pool.num_blocks and not engine.scheduler.requests
    return done


def greedy(cases: list[Case], **extra: Any) -> list[tuple[list[int], SamplingParams]]:
    return [
        (c.prompt, SamplingParams(max_tokens=c.max_tokens, temperature=0, **extra)) for c in cases
    ]


@pytest.mark.parametrize("num_blocks", [256, 24])
def test_async_steps_equal_steps_one_by_one_with_preemption_and_aborts(
    model_dirs: dict[str, Path], cases: list[Case], num_blocks: int
) -> None:
    """24 blocks of 16 tokens for prompts of up to 300: requests are preempted and
    recomputed; aborts land while a step of theirs is in flight."""
    requests = greedy(cases[:16])
    aborts = {2: [3], 5: [7, 8]}
    sync = run(make_engine(model_dirs["llama"], False, num_blocks), requests, aborts)
    engine = make_engine(model_dirs["llama"], True, num_blocks)
    overlapped = run(engine, requests, aborts)
    kept = set(range(16)) - {3, 7, 8}
    assert {i: sync[i] for i in kept} == {i: overlapped[i] for i in kept}
    if num_blocks == 24:
        assert engine.scheduler.num_preemptions > 0


def test_stop_strings_found_a_step_late_drop_the_extra_token(
    model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    base = run(make_engine(model_dirs["llama"], False), greedy(cases[2:8], ignore_eos=True))
    stops = {i: text[len(text) // 3 : len(text) // 3 + 3] for i, (_, text, _) in base.items()}
    requests = [
        (c.prompt, SamplingParams(max_tokens=c.max_tokens, temperature=0, stop=(stops[i],)))
        for i, c in enumerate(cases[2:8])
        if stops[i].strip()
    ]
    sync = run(make_engine(model_dirs["llama"], False), requests)
    overlapped = run(make_engine(model_dirs["llama"], True), requests)
    assert overlapped == sync
    assert any(reason == "stop" for _, _, reason in sync.values())


def test_requests_that_need_their_previous_token_run_one_step_at_a_time(
    model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    """A penalty needs the previous token on the host: the engine lands the step in flight and
    steps one by one while such a request runs, with the same results."""
    requests = greedy(cases[:4])
    requests.append((cases[5].prompt, SamplingParams(max_tokens=9, repetition_penalty=1.3)))
    assert run(make_engine(model_dirs["llama"], True), requests) == run(
        make_engine(model_dirs["llama"], False), requests
    )


def test_the_next_step_is_scheduled_while_the_step_before_computes(
    model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    engine = make_engine(model_dirs["llama"], True)
    for i, (prompt, params) in enumerate(greedy(cases[:3])):
        engine.add_request(str(i), prompt, params)
    gate, computing = threading.Event(), threading.Event()
    execute = engine.runner.execute

    def held(out: Any) -> tuple[Any, torch.Tensor]:
        computing.set()
        assert gate.wait(30), "the test never opened the gate"
        return execute(out)

    engine.runner.execute = held  # type: ignore[method-assign]
    scheduled = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: scheduled.append(1) or schedule()  # type: ignore[method-assign, func-returns-value]
    assert engine.step() == []  # step 1 submitted; nothing has landed yet
    assert computing.wait(30)
    second = threading.Thread(target=engine.step)
    second.start()
    for _ in range(3000):  # step 2 is scheduled while step 1 is still held in the worker
        if len(scheduled) == 2:
            break
        time.sleep(0.01)
    assert len(scheduled) == 2 and second.is_alive() and not gate.is_set()
    gate.set()
    second.join(30)
    assert not second.is_alive()
    engine.runner.execute = execute  # type: ignore[method-assign]
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.e2e
def test_a_server_with_async_scheduling_answers_as_one_without_and_frees_every_block(
    model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    """Real HTTP: concurrent streamed completions (one client leaving mid-stream) against a
    server with --async-scheduling give the texts of a server without it."""
    import concurrent.futures

    import httpx

    from tests.serve.server_util import start_thread_server

    def texts(url: str) -> list[str]:
        def one(case: Case) -> str:
            body = {
                "model": "test-model",
                "prompt": case.prompt[:40],
                "max_tokens": 12,
                "temperature": 0,
                "stream": True,
            }
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
            return "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            return list(pool.map(one, cases[:6]))

    def leave_mid_stream(url: str) -> None:
        body = {
            "model": "test-model",
            "prompt": cases[0].prompt[:40],
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))

    results = []
    for overlap in (False, True):
        server = start_thread_server(model_dirs["llama"], async_scheduling=overlap)
        try:
            leave_mid_stream(server.url)
            results.append(texts(server.url))
            pool = server.engine.engine.scheduler.pool
            for _ in range(500):  # the abort reaches the engine between two of its steps
                if pool.num_free_blocks == pool.num_blocks:
                    break
                time.sleep(0.01)
            assert pool.num_free_blocks == pool.num_blocks
        finally:
            server.stop()
    assert results[0] == results[1] and all(results[0])

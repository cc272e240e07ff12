"""What one request can hold on the server: outputs leave as deltas, an unread stream is merged
into one output and aborted past --max-unread-tokens, and a body of too many prompts is refused
before any work (issue 23's resource cases, each pinned by name)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import httpx
import pytest

from serve import LLM, SamplingParams
from serve.core.config import CacheConfig
from serve.core.sampling_params import OutputKind
from serve.engine.output_collector import ReaderTooSlow
from serve.http.middleware import MAX_CONTAINERS, json_containers
from tests.serve.conftest import Case
from tests.serve.server_util import start_thread_server
from tests.serve.test_server import metrics


@pytest.fixture(scope="module")
def llm(model_dirs: dict[str, Path]) -> LLM:
    return LLM(
        model_dirs["llama"], device="cpu", dtype="float32", cache=CacheConfig(num_blocks=256)
    )


def _run(llm: LLM, prompt: list[int], params: SamplingParams) -> list:
    engine = llm.engine
    engine.add_request("r", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("stop", [(), ("e",), ("he", "ll"), ("never",)])
def test_delta_outputs_add_up_to_the_cumulative_one(
    llm: LLM, cases: list[Case], stop: tuple[str, ...]
) -> None:
    prompt = cases[4].prompt[:30]
    base = SamplingParams(max_tokens=30, temperature=0, logprobs=1, stop=stop)
    whole = _run(llm, prompt, base)[-1]
    deltas = _run(llm, prompt, dataclasses.replace(base, output_kind=OutputKind.DELTA))
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert [lp for d in deltas for lp in d.logprobs] == whole.logprobs
    sent = ""
    for d in deltas:  # no prefix of the stop string is ever sent and later taken back
        sent += d.text
        assert whole.text.startswith(sent)
    assert [d.num_output_tokens for d in deltas][-1] == len(whole.token_ids)


def test_final_only_returns_one_output(llm: LLM, cases: list[Case]) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, output_kind=OutputKind.FINAL_ONLY)
    outputs = _run(llm, cases[2].prompt[:20], params)
    assert len(outputs) == 1 and outputs[0].finished and len(outputs[0].token_ids) == 12


def test_a_streaming_client_that_never_reads_is_aborted_at_the_bound(
    model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    """Issue 23: two streaming clients that never read grew the server by 550 MB (every output
    carried the cumulative ids, text and logprobs, queued without bound)."""
    s = start_thread_server(model_dirs["llama"], max_unread_tokens=16)
    loop = s.engine._loop
    assert loop is not None
    params = SamplingParams(
        max_tokens=400, temperature=0, ignore_eos=True, logprobs=5, output_kind=OutputKind.DELTA
    )
    try:
        added = [
            asyncio.run_coroutine_threadsafe(
                s.engine.add(f"never-read-{i}", cases[1].prompt[:10], params), loop
            ).result()
            for i in range(2)
        ]
        deadline = time.monotonic() + 60
        while not all(t.finished for t in added) and time.monotonic() < deadline:
            time.sleep(0.05)
        for t in added:
            assert t.finished and t.num_tokens < 400
            assert isinstance(t.collector.item, ReaderTooSlow)  # the unread outputs were dropped
            with pytest.raises(ReaderTooSlow, match="--max-unread-tokens"):
                asyncio.run_coroutine_threadsafe(t.collector.get(), loop).result()
        assert metrics(s.url)["workbench:request_success_total[slow_reader]"] == 2
        deadline = time.monotonic() + 10
        engine = s.engine.engine
        while engine.scheduler.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks
    finally:
        s.stop()


def test_a_reader_that_keeps_up_gets_the_whole_stream(
    model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    s = start_thread_server(model_dirs["llama"], max_unread_tokens=64)
    try:
        body = {
            "model": "test-model",
            "prompt": cases[1].prompt[:10],
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=120) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert '"completion_tokens": 300' in lines[-1]
    finally:
        s.stop()


def test_json_containers_are_counted_outside_strings() -> None:
    text = 'a [ { \\" [[ "quoted" {' * 4000  # brackets and escaped quotes inside one string
    assert json_containers(json.dumps({"prompt": text, "stop": ["[", "{"]}).encode()) == 2
    many = json.dumps({"prompt": [[5]] * 20_000}).encode()
    assert json_containers(many) == 20_002 > MAX_CONTAINERS  # and the outer list and object


def test_a_body_of_many_small_lists_is_refused_unparsed_on_every_route(
    model_dirs: dict[str, Path],
) -> None:
    """The 300k-prompt body's class: its parse alone stalled the event loop 0.2 s, whatever the
    route then refused; refused before parsing, on any POST route."""
    s = start_thread_server(model_dirs["llama"])
    try:
        body = json.dumps({"model": "test-model", "prompt": [[5]] * 300_000}).encode()
        for route in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            r = httpx.post(f"{s.url}{route}", content=body, timeout=60)
            assert r.status_code == 400, route
            assert r.json()["error"]["message"].startswith(
                "the request body holds 300002 JSON arrays and objects; at most"
            )
        ok = httpx.post(f"{s.url}/tokenize", json={"model": "test-model", "prompt": "a [b] {c}"})
        assert ok.status_code == 200
    finally:
        s.stop()


def test_300k_prompt_body_is_refused_before_any_work(
    model_dirs: dict[str, Path],
) -> None:
    """Issue 23: `{"prompt": [[5]] x 300,000, "n": 16}` was answered 503 only after 14 s, the
    server 1 GB larger, a concurrent stream stalled 1.5 s."""
    s = start_thread_server(model_dirs["llama"])
    try:
        body = {"model": "test-model", "prompt": [[5]] * 300_000, "n": 16}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "at most 2048" in r.json()["error"]["message"]
        assert s.engine.num_unfinished == 0 and not s.engine.engine.scheduler.requests
        many = {"model": "test-model", "prompt": [[5]] * 2000, "n": 16}  # within the bound
        busy = httpx.post(f"{s.url}/v1/completions", json=many, timeout=60)
        assert busy.status_code == 503 and s.engine.num_unfinished == 0
    finally:
        s.stop()

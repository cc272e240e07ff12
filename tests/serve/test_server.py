"""The HTTP server, for real: uvicorn on 127.0.0.1, the `openai` client, httpx, prometheus."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve import LLM, SamplingParams
from serve.core.config import CacheConfig
from tests.serve.conftest import Case
from tests.serve.server_util import (
    ThreadServer,
    slow_steps_for,
    slow_steps_until_abort,
    start_thread_server,
    wait_engine_drained,
)


@pytest.fixture(scope="module")
def offline(model_dirs: dict[str, Path]) -> LLM:
    return LLM(
        model_dirs["llama"], device="cpu", dtype="float32", cache=CacheConfig(num_blocks=1024)
    )


def metrics(url: str, api_key: str | None = None) -> dict[str, float]:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{url}/metrics", headers=headers).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + (
                f"[{sample.labels['finished_reason']}]"
                if "finished_reason" in sample.labels
                else ""
            )
            out[key] = sample.value
    return out


def test_completion_matches_the_offline_engine(
    client: openai.OpenAI, offline: LLM, cases: list[Case]
) -> None:
    prompt = cases[3].prompt
    resp = client.completions.create(
        model="test-model", prompt=prompt, max_tokens=20, temperature=0
    )
    expected = offline.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0]
    assert resp.choices[0].text == expected.text
    assert resp.usage.prompt_tokens == len(prompt) and resp.usage.completion_tokens == len(
        expected.token_ids
    )
    seeded = client.completions.create(
        model="test-model", prompt=prompt, max_tokens=20, temperature=0.9, seed=7
    )
    expected = offline.generate([prompt], SamplingParams(max_tokens=20, temperature=0.9, seed=7))[0]
    assert seeded.choices[0].text == expected.text


def test_streamed_completion_equals_whole(client: openai.OpenAI, cases: list[Case]) -> None:
    prompt = cases[5].prompt
    whole = client.completions.create(
        model="test-model", prompt=prompt, max_tokens=24, temperature=0
    )
    stream = client.completions.create(
        model="test-model",
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason


def test_chat_matches_the_offline_engine_streamed_or_not(
    client: openai.OpenAI, offline: LLM, model_dirs: dict[str, Path]
) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a module."},
    ]
    resp = client.chat.completions.create(
        model="test-model", messages=messages, max_tokens=16, temperature=0
    )
    tok = offline.engine.tokenizer
    ids = tok(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    ).input_ids
    expected = offline.generate([ids], SamplingParams(max_tokens=16, temperature=0))[0]
    assert (
        resp.choices[0].message.content == expected.text
        and resp.choices[0].message.role == "assistant"
    )
    assert resp.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model="test-model", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_n_choices_and_stop_strings(client: openai.OpenAI, cases: list[Case]) -> None:
    prompt = cases[8].prompt
    resp = client.completions.create(
        model="test-model", prompt=prompt, max_tokens=12, n=3, temperature=1.0, seed=3
    )
    assert [c.index for c in resp.choices] == [0, 1, 2] and resp.usage.completion_tokens == 36
    assert len({c.text for c in resp.choices}) > 1
    free = (
        client.completions.create(model="test-model", prompt=prompt, max_tokens=30, temperature=0)
        .choices[0]
        .text
    )
    stop = free[8:11]
    for stream in (False, True):
        r = client.completions.create(
            model="test-model",
            prompt=prompt,
            max_tokens=30,
            temperature=0,
            stop=[stop],
            stream=stream,
        )
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert text == free[: free.find(stop)]


def test_echo_logprobs_with_zero_max_tokens(
    server: ThreadServer, offline: LLM, cases: list[Case]
) -> None:
    """What lm-eval's local-completions sends for loglikelihood requests."""
    prompt = cases[9].prompt[:40]
    body = {
        "model": "test-model",
        "prompt": prompt,
        "max_tokens": 0,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    expected = offline.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    lp = choice["logprobs"]
    assert choice["text"] == offline.engine.tokenizer.decode(prompt, skip_special_tokens=True)
    assert len(lp["tokens"]) == len(prompt) and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [
        expected.prompt_logprobs[i][t] for i, t in enumerate(prompt) if i
    ]
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_models_health_and_metrics_endpoints(server: ThreadServer) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["test-model"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    names = {
        f.name for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    }
    assert {
        "workbench:time_to_first_token_seconds",
        "workbench:inter_token_latency_seconds",
        "workbench:e2e_request_latency_seconds",
        "workbench:num_requests_running",
        "workbench:num_requests_waiting",
        "workbench:kv_cache_usage_perc",
        "workbench:prefix_cache_queries",
        "workbench:prefix_cache_hits",
        "workbench:num_preemptions",
        "workbench:prompt_tokens",
        "workbench:generation_tokens",
        "workbench:request_success",
    } <= names


def test_metrics_counters_agree_with_what_was_sent(server: ThreadServer, cases: list[Case]) -> None:
    before = metrics(server.url)
    prompts = [c.prompt[:30] for c in cases[10:16]]
    completion_tokens = 0
    for p in prompts:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={
                "model": "test-model",
                "prompt": p,
                "max_tokens": 7,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )
        completion_tokens += r.json()["usage"]["completion_tokens"]
    after = metrics(server.url)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["workbench:request_success_total[length]"] == 6
    assert delta["workbench:prompt_tokens_total"] == sum(map(len, prompts))
    assert delta["workbench:generation_tokens_total"] == completion_tokens == 42
    assert delta["workbench:time_to_first_token_seconds_count"] == 6
    assert delta["workbench:inter_token_latency_seconds_count"] == 36
    assert delta["workbench:e2e_request_latency_seconds_count"] == 6
    assert after["workbench:num_requests_running"] == 0


async def _stream_one(
    client: httpx.AsyncClient, url: str, prompt: list[int], cancel_after: int | None
) -> str | None:
    body = {
        "model": "test-model",
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
    }
    text, events = "", 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text
            text += json.loads(line[6:])["choices"][0]["text"]
            events += 1
            if cancel_after is not None and events >= cancel_after:
                return None  # leaving the block closes the connection mid-stream
    raise AssertionError("stream ended without [DONE]")


def test_200_concurrent_streams_50_cancelled(
    server: ThreadServer, offline: LLM, cases: list[Case]
) -> None:
    prompts = [cases[i % 32].prompt[: 20 + i % 40] for i in range(200)]
    cancelled = set(range(0, 200, 4))

    async def run_all() -> list[str | None]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(
                *(
                    _stream_one(client, server.url, p, 3 if i in cancelled else None)
                    for i, p in enumerate(prompts)
                )
            )

    results = asyncio.run(run_all())
    expected = offline.generate(
        [prompts[i] for i in range(200) if i not in cancelled],
        SamplingParams(max_tokens=24, temperature=0),
    )
    got = [results[i] for i in range(200) if i not in cancelled]
    assert got == [e.text for e in expected]
    engine = server.engine.engine
    for _ in range(100):  # aborts land between engine steps
        m = metrics(server.url)
        if (
            m["workbench:num_requests_running"] == 0
            and m["workbench:kv_cache_free_blocks"] == m["workbench:kv_cache_total_blocks"]
        ):
            break
        asyncio.run(asyncio.sleep(0.05))
    assert m["workbench:num_requests_running"] == 0 and m["workbench:num_requests_waiting"] == 0
    assert (
        m["workbench:kv_cache_free_blocks"]
        == m["workbench:kv_cache_total_blocks"]
        == engine.runner.num_blocks
    )


def test_client_disconnect_aborts_a_non_streaming_request(
    server: ThreadServer, cases: list[Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine steps are slowed until the server asks for the abort, so the request is still
    running when the client gives up, however fast the machine (400 tokens: 8 s)."""
    engine = server.engine.engine
    asked = slow_steps_until_abort(server, monkeypatch)
    body = {
        "model": "test-model",
        "prompt": cases[2].prompt[:50],
        "max_tokens": 400,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    wait_engine_drained(server)
    assert len(asked) == 1
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks


def _leave_after_first_chunk(url: str, body: dict) -> None:
    """Open a stream, read its first chunk, and go away (the connection is closed)."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())


def test_disconnect_aborts_every_choice_of_an_n_8_stream(
    server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 67.6: the stream's cleanup awaited one abort per choice in a cancelled scope, so
    only the first was asked and 7 of 8 ran on. Steps are slowed until an abort is asked, so
    every choice is still running when the client leaves."""
    engine = server.engine.engine
    asked = slow_steps_until_abort(server, monkeypatch)
    body = {"model": "test-model", "prompt": [11, 12], "max_tokens": 400, "ignore_eos": True}
    _leave_after_first_chunk(server.url, {**body, "n": 8, "stream": True})
    wait_engine_drained(server)
    assert sorted(r.rsplit("-", 1)[1] for r in asked) == [str(i) for i in range(8)]
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks


def test_clients_that_leave_n_16_streams_do_not_wedge_the_server(
    server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = slow_steps_until_abort(server, monkeypatch)
    body = {"model": "test-model", "prompt": [11, 12], "max_tokens": 400, "ignore_eos": True}
    for _ in range(4):
        _leave_after_first_chunk(server.url, {**body, "n": 16, "stream": True})
    wait_engine_drained(server)
    assert len(set(asked)) == 64
    normal = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 4}, timeout=60)
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 4


def test_n_counts_against_max_waiting_as_n_requests(model_dirs: dict[str, Path]) -> None:
    """Issue 67.6: each of a request's prompts x n choices counts against --max-waiting as a
    request would, before any work (nothing is added, nothing is left queued)."""
    s = start_thread_server(model_dirs["llama"], max_waiting=8)
    try:
        body = {"model": "test-model", "prompt": [11, 12], "max_tokens": 2}
        chat = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "n": 9}
        for path, over in (
            ("/v1/completions", {**body, "n": 9}),
            ("/v1/completions", {**body, "prompt": [[11]] * 3, "n": 3}),
            ("/v1/chat/completions", chat),
        ):
            r = httpx.post(f"{s.url}{path}", json=over, timeout=60)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert s.engine.num_unfinished == 0 and not s.engine.engine.scheduler.requests
        ok = httpx.post(f"{s.url}/v1/completions", json={**body, "n": 8}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 8
    finally:
        s.stop()


def test_api_key_guards_every_route_but_health(model_dirs: dict[str, Path]) -> None:
    s = start_thread_server(model_dirs["llama"], api_key="sekret")
    try:
        assert httpx.get(f"{s.url}/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(f"{s.url}{path}")
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekret", max_retries=0)
        assert (
            client.completions.create(
                model="test-model", prompt="a", max_tokens=2
            ).usage.completion_tokens
            >= 1
        )
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        s.stop()


def test_full_waiting_queue_answers_503_with_retry_after(
    model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    s = start_thread_server(model_dirs["llama"], max_num_seqs=1, max_waiting=2)
    body = {
        "model": "test-model",
        "prompt": cases[1].prompt[:20],
        "max_tokens": 200,
        "ignore_eos": True,
    }

    async def burst() -> list[httpx.Response]:
        slow_steps_for(s, 1.0)  # all six arrive while the first still runs
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(client.post(f"{s.url}/v1/completions", json=body) for _ in range(6))
            )

    try:
        statuses = [r.status_code for r in asyncio.run(burst())]
        busy = [r for r in asyncio.run(burst()) if r.status_code == 503]
        # two waiting (and one running, once a step has scheduled it) are admitted; the rest
        # are told to come back
        assert 2 <= statuses.count(200) <= 3 and statuses.count(503) == 6 - statuses.count(200)
        assert 3 <= len(busy) <= 4
        assert all(
            r.headers["retry-after"] == "1" and "waiting requests" in r.json()["error"]["message"]
            for r in busy
        )
    finally:
        s.stop()


@pytest.mark.e2e
def test_sigterm_lets_running_requests_finish(
    model_dirs: dict[str, Path], cases: list[Case], tmp_path: Path
) -> None:
    import signal

    from tests.serve.server_util import start_subprocess_server

    proc, url = start_subprocess_server(
        model_dirs["llama"], tmp_path / "server.log", "--grace-period", "60"
    )
    body = {
        "model": "test-model",
        "max_tokens": 150,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(i: int) -> int:
                events, tokens = 0, 0
                json_body = {**body, "prompt": cases[i].prompt[:30]}
                async with client.stream("POST", f"{url}/v1/completions", json=json_body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            events += 1
                            if events == 5 and i == 0:
                                proc.send_signal(signal.SIGTERM)
                            if usage := json.loads(line[6:]).get("usage"):
                                tokens = usage["completion_tokens"]
                return tokens

            return await asyncio.gather(*(one(i) for i in range(8)))

    try:
        counts = asyncio.run(run())
        assert proc.wait(timeout=90) == 0, (tmp_path / "server.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert counts == [150] * 8, "a running request was cut off by the shutdown"
    assert "Shutting down" in (tmp_path / "server.log").read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)

"""Regression tests for requests that used to kill, freeze or fool the server (issue 11, items
1-9), each against a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from serve.core.sampling_params import SamplingParams
from serve.http import completions, serving
from serve.model.sampler import SampleInput, Sampler
from tests.serve.server_util import ThreadServer, slow_steps_until_abort, start_thread_server
from tests.serve.test_server import metrics

GREEDY = {"model": "test-model", "prompt": [11, 12, 13, 14], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(model_dirs: dict[str, Path]) -> Iterator[ThreadServer]:
    s = start_thread_server(model_dirs["llama"], max_waiting=1000, api_key="k")
    yield s
    s.stop()


def post(s: ThreadServer, path: str, body: object, **kw: object) -> httpx.Response:
    headers = {"authorization": "Bearer k", **kw.pop("headers", {})}  # type: ignore[dict-item]
    return httpx.post(f"{s.url}{path}", json=body, headers=headers, timeout=60, **kw)  # type: ignore[arg-type]


def greedy_text(s: ThreadServer) -> str:
    r = post(s, "/v1/completions", GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def wait_idle(s: ThreadServer) -> None:
    for _ in range(400):
        if s.engine.num_unfinished == 0 and s.engine.stats.num_running == 0:
            return
        time.sleep(0.025)
    raise AssertionError("requests still running")


# --- 1. sampling values that made NaN/inf ---


@pytest.mark.parametrize(
    ("route", "extra"),
    [
        ("/v1/completions", {"temperature": 1e-45}),
        ("/v1/completions", {"top_p": 1e-300}),
        ("/v1/completions", {"temperature": 1e-45, "top_p": 1e-300, "seed": 3}),
        ("/v1/chat/completions", {"temperature": 1e-45}),
        ("/v1/chat/completions", {"top_p": 1e-300}),
    ],
)
def test_tiny_temperature_or_top_p_does_not_kill_the_engine(
    server: ThreadServer, route: str, extra: dict
) -> None:
    before = greedy_text(server)
    if route == "/v1/completions":
        body = {**GREEDY, **extra}
    else:
        body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
        body.update(max_tokens=8, **extra)
    r = post(server, route, body)
    assert r.status_code == 200, r.text
    assert server.engine.dead is None and server.engine.healthy
    assert greedy_text(server) == before


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_top_token() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(0)
    tiny_t = SampleInput(SamplingParams(temperature=1e-45), None)
    tiny_p = SampleInput(SamplingParams(top_p=1e-300), None)
    tokens = [s.token_id for s in sampler.sample(logits[:2], [tiny_t, tiny_p])]
    assert tokens == logits[:2].argmax(-1).tolist()


def test_sampler_survives_nan_and_inf_logits() -> None:
    row = torch.full((1, 20), float("nan"))
    row[0, 7] = 5.0
    inf_row = torch.zeros(1, 20)
    inf_row[0, 3] = float("inf")
    params = SamplingParams(temperature=0.7, logprobs=2)
    for logits in (row, inf_row):
        (out,) = Sampler(0).sample(logits, [SampleInput(params, None)])
        assert 0 <= out.token_id < 20
        assert out.logprobs is not None
        assert all(v == v and abs(v) != float("inf") for v in out.logprobs.values())


# --- 2. a failing step fails only its requests; a crash loop is unhealthy ---

POISON = 7


def poison_forward(s: ThreadServer, always: bool = False) -> object:
    runner = s.engine.engine.runner
    original = runner.forward

    def forward(inputs, lora=None):  # type: ignore[no-untyped-def]
        if always or bool((inputs.input_ids == POISON).any()):
            raise RuntimeError("simulated kernel failure")
        return original(inputs, lora)

    runner.forward = forward  # type: ignore[method-assign]
    return original


def test_a_failing_step_ends_only_its_requests_and_the_engine_serves_on(
    server: ThreadServer,
) -> None:
    before = greedy_text(server)
    original = poison_forward(server)
    try:
        r = post(server, "/v1/completions", {**GREEDY, "prompt": [POISON, 12]})
        assert r.status_code == 500
        assert "other requests are unaffected" in r.json()["error"]["message"]
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={**GREEDY, "prompt": [POISON, 13], "stream": True},
            headers={"authorization": "Bearer k"},
            timeout=60,
        ) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
        assert greedy_text(server) == before
    finally:
        server.engine.engine.runner.forward = original  # type: ignore[method-assign]
    wait_idle(server)
    engine = server.engine.engine
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert metrics(server.url, "k")["workbench:request_success_total[error]"] >= 2


def test_repeated_step_failures_make_health_unhealthy_until_a_step_succeeds(
    server: ThreadServer,
) -> None:
    original = poison_forward(server, always=True)
    try:
        for i in range(3):
            assert post(server, "/v1/completions", {**GREEDY, "seed": i}).status_code == 500
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "failed" in health.json()["status"]
    finally:
        server.engine.engine.runner.forward = original  # type: ignore[method-assign]
    greedy_text(server)
    assert httpx.get(f"{server.url}/health").status_code == 200


# --- 4. client disconnect on a non-streaming request behind the API-key middleware ---


def test_client_disconnect_aborts_a_non_streaming_request_behind_the_api_key(
    server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    wait_idle(server)
    asked = slow_steps_until_abort(server, monkeypatch)  # still running when the client leaves
    before = metrics(server.url, "k")
    body = b'{"model": "test-model", "prompt": [11, 12], "max_tokens": 480, "ignore_eos": true}'
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer k\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        for _ in range(200):  # until the request runs
            if server.engine.stats.num_running:
                break
            time.sleep(0.01)
    wait_idle(server)
    after = metrics(server.url, "k")
    aborted = after.get("workbench:request_success_total[abort]", 0) - before.get(
        "workbench:request_success_total[abort]", 0
    )
    generated = after["workbench:generation_tokens_total"] - before.get(
        "workbench:generation_tokens_total", 0
    )
    assert aborted == 1 and generated < 480 and len(asked) == 1


# --- 5. edge input that gave 500 ---


@pytest.mark.parametrize(
    ("route", "body", "status", "words"),
    [
        ("/v1/completions", {**GREEDY, "prompt": "a\ud800b"}, 400, "lone surrogate"),
        (
            "/v1/chat/completions",
            {"model": "test-model", "messages": [{"role": "user", "content": "\ud800"}]},
            400,
            "lone surrogate",
        ),
        ("/v1/completions", {**GREEDY, "stop": ["\udfff"]}, 400, "lone surrogate"),
        ("/v1/completions", {**GREEDY, "seed": 2**64}, 400, "seed"),
        ("/v1/completions", {**GREEDY, "seed": -(2**63) - 1}, 400, "seed"),
        ("/v1/completions", {**GREEDY, "seed": 2**64 - 1, "n": 2, "temperature": 1}, 200, ""),
        ("/v1/completions", {**GREEDY, "seed": -(2**63), "temperature": 1}, 200, ""),
        (
            "/v1/chat/completions",
            {
                "model": "test-model",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}],
            },
            400,
            "text parts only",
        ),
    ],
)
def test_edge_input_gets_4xx_or_an_answer_never_500(
    server: ThreadServer, route: str, body: dict, status: int, words: str
) -> None:
    r = httpx.post(
        f"{server.url}{route}",
        content=json.dumps(body),  # ASCII JSON: lone surrogates travel as escapes
        headers={"authorization": "Bearer k", "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    if status == 400:
        assert words in r.json()["error"]["message"]


def test_chat_content_as_text_parts_equals_plain_content(server: ThreadServer) -> None:
    def chat(content: object) -> str:
        body = {"model": "test-model", "max_tokens": 6, "temperature": 0}
        r = post(
            server,
            "/v1/chat/completions",
            {**body, "messages": [{"role": "user", "content": content}]},
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    assert chat(parts) == chat("hello\nthere")


# --- 6. gauges after aborts ---


def test_gauges_drop_when_the_last_running_requests_are_aborted(
    server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    wait_idle(server)
    slow_steps_until_abort(server, monkeypatch)  # still running while the gauges are read
    body = {**GREEDY, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json=body,
        headers={"authorization": "Bearer k"},
        timeout=60,
    ) as stream:
        lines = stream.iter_lines()
        first = next(lines)
        assert metrics(server.url, "k")["workbench:num_requests_running"] == 1, (
            first,
            server.engine.stats,
            server.engine.num_unfinished,
            list(lines)[-3:],
        )
    for _ in range(200):  # no other request arrives: only the abort can refresh the gauges
        m = metrics(server.url, "k")
        if m["workbench:num_requests_running"] == 0:
            break
        time.sleep(0.025)
    assert m["workbench:num_requests_running"] == 0
    assert m["workbench:kv_cache_usage_perc"] == 0
    assert m["workbench:kv_cache_free_blocks"] == server.engine.engine.runner.num_blocks


# --- 7. tokenizing off the event loop, with bounded work ---


def test_tokenizing_runs_off_the_event_loop(
    server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    real = serving.encode

    def slow_encode(*args, **kwargs):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(completions, "encode", slow_encode)
    result: list[httpx.Response] = []
    worker = threading.Thread(
        target=lambda: result.append(post(server, "/v1/completions", {**GREEDY, "prompt": "hi"}))
    )
    worker.start()
    assert entered.wait(30)
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200  # the loop is free
    release.set()
    worker.join(60)
    assert result[0].status_code == 200


def test_the_server_encodes_with_its_own_tokenizer(server: ThreadServer) -> None:
    """Prompts are encoded on worker threads and the engine thread decodes: not one object."""
    ours, engines = server.engine.tokenizer, server.engine.engine.tokenizer
    assert ours is not engines
    assert ours("a b c").input_ids == engines("a b c").input_ids


def test_a_3mb_prompt_is_refused_after_tokenizing_a_bounded_prefix(server: ThreadServer) -> None:
    tok = server.engine.engine.tokenizer
    seen: list[int] = []

    class Spy:
        def __call__(self, text: str, **kw: object) -> object:
            seen.append(len(text))
            return tok(text, **kw)

    text = "the quick brown fox jumps. " * 120_000
    with pytest.raises(serving.RequestError, match="context length"):
        serving.encode(Spy(), text, 512)  # type: ignore[arg-type]
    assert seen == [512 * serving.CHARS_PER_TOKEN_BOUND]
    r = post(server, "/v1/completions", {**GREEDY, "prompt": text})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# --- 8. default max_tokens on a KV cache smaller than max_model_len ---


def test_chat_without_max_tokens_fits_a_small_kv_cache(model_dirs: dict[str, Path]) -> None:
    s = start_thread_server(model_dirs["llama"], num_blocks=6, max_model_len=512)  # 96 tokens
    try:
        body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(
            f"{s.url}/v1/chat/completions", json={**body, "ignore_eos": True}, timeout=60
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 96
        assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        s.stop()


# --- 9. strict types; JSON without a JSON content type ---


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**GREEDY, "prompt": [True, False]}, "prompt"),
        ({**GREEDY, "stream": "yes"}, "stream"),
        ({**GREEDY, "temperature": "0.5"}, "temperature"),
        ({**GREEDY, "max_tokens": 4.0}, "max_tokens"),
        ({**GREEDY, "echo": 1}, "echo"),
    ],
)
def test_loosely_typed_fields_are_refused(server: ThreadServer, body: dict, field: str) -> None:
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(field)


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_json_body_without_a_json_content_type_works(
    server: ThreadServer, content_type: str | None
) -> None:
    headers = {"authorization": "Bearer k"}
    if content_type:
        headers["content-type"] = content_type
    r = httpx.post(
        f"{server.url}/v1/completions", content=json.dumps(GREEDY), headers=headers, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_text(server)

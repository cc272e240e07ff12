"""The grammar backend as the server drives it (issue 67.4-5): grammars compile in the grammar
worker, beside the step loop, within a time bound, and the compiled grammars are cached within a
byte bound. Real HTTP against a running server; stalls are shown with a gate the test holds (the
worker blocked on an Event while another stream runs to its end), never with timings."""

from __future__ import annotations

import json
import random
import string
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from serve.core.sampling_params import Grammar
from serve.model import grammar_engines
from serve.model.grammar import GrammarBackend, Prepared
from tests.serve.server_util import ThreadServer, start_thread_server, wait_engine_drained

BODY = {"model": "test-model", "prompt": [11, 12], "max_tokens": 8, "temperature": 0}


@pytest.fixture
def server(model_dirs: dict[str, Path]) -> Iterator[ThreadServer]:
    """A fresh server per test: each sets its own grammar bounds before the first grammar."""
    s = start_thread_server(model_dirs["llama"], max_waiting=1000)
    yield s
    s.stop()


def backend(s: ThreadServer) -> GrammarBackend:
    return s.engine.engine.grammars


def gate_compiles(s: ThreadServer, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every compile waits for the returned Event (set it to let them through)."""
    gate, real = threading.Event(), backend(s).compile

    def compile(grammar: Grammar) -> Prepared:
        assert gate.wait(60), "the test never opened the gate"
        return real(grammar)

    monkeypatch.setattr(backend(s), "compile", compile)
    return gate


def big_choices(seed: int = 0) -> list[str]:
    """Issue 67.4's grammar: 256 choices of 600 characters (9.8 s of stall when it compiled
    on the step loop)."""
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase, k=600)) for _ in range(256)]


def in_thread(fn: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(fn()), daemon=True)
    thread.start()
    return thread, answers


def stream_tokens(url: str, max_tokens: int) -> int:
    """Tokens a whole stream delivered (its usage chunk)."""
    body = {**BODY, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    tokens = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                tokens = usage["completion_tokens"]
    return tokens


def test_big_choice_grammar_compiles_off_the_step_loop(
    server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the 256 x 600-character grammar cannot compile (its worker is held), another
    stream runs to its end: the request waits for its grammar outside the engine."""
    gate = gate_compiles(server, monkeypatch)
    choices = big_choices()
    body = {**BODY, "max_tokens": 200, "structured_outputs": {"choice": choices}}
    url = f"{server.url}/v1/completions"
    waiting, answers = in_thread(lambda: httpx.post(url, json=body, timeout=120))
    assert stream_tokens(server.url, 64) == 64
    assert waiting.is_alive() and not answers  # still waiting for its grammar
    gate.set()
    waiting.join(120)
    assert answers[0].status_code == 200, answers[0].text
    text = answers[0].json()["choices"][0]["text"]  # 200 tokens: the start of one choice
    assert text and any(c.startswith(text) for c in choices)


def test_a_grammar_past_its_compile_time_bound_is_400(
    server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = gate_compiles(server, monkeypatch)
    monkeypatch.setattr(backend(server), "compile_timeout_s", 0.2)
    body = {**BODY, "n": 3, "structured_outputs": {"choice": big_choices(1)}}
    try:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    finally:
        gate.set()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (
        error["param"] == "structured_outputs"
        and "did not compile within 0.2 s" in (error["message"])
    )
    wait_engine_drained(server)
    assert backend(server).matchers == {} and backend(server)._prepared == {}
    engine = server.engine.engine
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks


def schema(i: int, description_chars: int) -> dict:
    """A distinct schema: `enum` values make its compiled grammar large, the description its
    text."""
    return {
        "type": "object",
        "description": "d" * description_chars,
        "properties": {f"k{i}": {"enum": [f"v{i}-{j}-{'x' * 40}" for j in range(200)]}},
        "required": [f"k{i}"],
    }


def test_distinct_schema_flood_keeps_grammar_caches_within_their_bounds(
    server: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 67.5: 240 distinct 3 MB schemas grew RSS 0.8 -> 2.3 GB (caches bounded by count,
    or not at all). Both caches are bounded by bytes here, evicting the least recently used."""
    grammars = backend(server)
    grammars.cache_bytes = 256 << 10  # read when its compiler is built, by the first grammar
    routes = grammar_engines.RouteCache(400_000)
    monkeypatch.setattr(grammar_engines, "ROUTES", routes)
    compiled_bytes = []
    real = grammars.compile

    def compile(grammar: Grammar) -> Prepared:
        prepared = real(grammar)
        compiled_bytes.append(prepared.compiled.memory_size_bytes)
        return prepared

    monkeypatch.setattr(grammars, "compile", compile)
    for i in range(24):
        body = {**BODY, "structured_outputs": {"json": schema(i, 20_000)}}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert grammars.cached_bytes <= grammars.cache_bytes
        assert routes.chars <= routes.max_chars
    assert grammars.cached_bytes > 0
    assert sum(compiled_bytes) > 2 * grammars.cache_bytes  # so the bound did evict
    assert len(routes._routes) < 24
    first = {**BODY, "structured_outputs": {"json": schema(0, 20_000)}}  # evicted: compiled again
    assert httpx.post(f"{server.url}/v1/completions", json=first, timeout=60).status_code == 200


def test_a_3mb_schema_is_refused_by_its_size(server: ThreadServer) -> None:
    body = {**BODY, "structured_outputs": {"json": schema(0, 3_000_000)}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs.json"
    assert "at most 262144" in r.json()["error"]["message"]
    assert backend(server).cached_bytes == 0


def test_the_offline_path_still_compiles_on_add(server: ThreadServer) -> None:
    """`LLMEngine.add_request` without a grammar handed over compiles it there (the offline
    API); the matcher is the same kind either way."""
    grammars = backend(server)
    grammar = Grammar("choice", json.dumps(["yes", "no"]))
    grammars.add("offline-1", grammar)
    try:
        assert "offline-1" in grammars.batched
    finally:
        grammars.release("offline-1")

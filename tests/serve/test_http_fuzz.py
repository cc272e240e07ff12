"""Property-based HTTP fuzzing of every endpoint (issue 11): any body, well-formed or not, gets a
2xx or a 4xx with an OpenAI error object, never a 5xx; afterwards the server is healthy and a
fixed greedy request returns exactly the text it returned before."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve.lora.registry import LoraConfig
from tests.serve.server_util import ThreadServer, start_thread_server, wait_engine_drained

JSON = {"content-type": "application/json"}
GREEDY = {"model": "test-model", "prompt": [31, 32, 33], "max_tokens": 8, "temperature": 0}

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
    | st.sampled_from(["test-model", "", "\ud800", "\x00", "user", "text", "../../etc/passwd"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

SAMPLING_EXTENSIONS = [
    "min_p",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "response_format",
    "structured_outputs",
]
"""Fields both generation routes take (vLLM's sampling extensions, structured outputs)."""

FIELDS = {
    "/v1/completions": [
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "n",
        "stream",
        "stream_options",
        "ignore_eos",
        "logprobs",
        "echo",
        "user",
        "best_of",
        *SAMPLING_EXTENSIONS,
    ],
    "/v1/chat/completions": [
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "stream",
        "logprobs",
        "top_logprobs",
        "ignore_eos",
        *SAMPLING_EXTENSIONS,
    ],
    "/v1/load_lora_adapter": ["lora_name", "lora_path", "evict"],
    "/v1/unload_lora_adapter": ["lora_name"],
    "/tokenize": ["model", "prompt", "messages", "add_special_tokens", "return_token_strs"],
    "/detokenize": ["model", "tokens"],
}
GOOD_VALUES = {
    "model": st.sampled_from(["test-model", "nope", "fz"]),
    "prompt": st.one_of(
        st.text(max_size=40),
        st.sampled_from(["a\ud800b", "\udfff", "x" * 5000]),
        st.lists(st.integers(-5, 600), max_size=20),
        st.lists(st.text(max_size=10), max_size=3),
    ),
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "tool"]),
                "content": st.text(max_size=30)
                | st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.sampled_from(["text", "image_url"]),
                            "text": st.text(max_size=10),
                        }
                    ),
                    max_size=2,
                ),
            }
        ),
        max_size=3,
    ),
    "max_tokens": st.integers(-2, 80),
    "max_completion_tokens": st.integers(-2, 80),
    "temperature": st.floats(0, 3) | st.sampled_from([1e-45, 1e-6, 0.0]),
    "top_p": st.floats(0, 1.5) | st.sampled_from([1e-300, 1e-45]),
    "top_k": st.integers(-1, 70_000),
    "seed": st.integers(-(2**65), 2**65),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=3), max_size=6),
    "n": st.integers(-1, 20),
    "logprobs": st.integers(-1, 25) | st.booleans(),
    "top_logprobs": st.integers(-1, 25),
    "min_p": st.floats(-0.5, 1.5),
    "min_tokens": st.integers(-1, 100),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 11),
    "logit_bias": st.dictionaries(
        st.sampled_from(["5", "31", "-1", "x", "99999999", "0"]), st.floats(-150, 150), max_size=3
    ),
    "stop_token_ids": st.lists(st.integers(-5, 10**7), max_size=4),
    "tokens": st.lists(st.integers(-5, 10**6), max_size=20),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer"}}},
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"if": {}}}},
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}},
            {"type": "json_schema"},
            {"type": "xml"},
        ]
    ),
    "structured_outputs": st.sampled_from(
        [
            {"regex": "[ab]{1,3}"},
            {"regex": "a("},
            {"choice": ["x", "y"]},
            {"choice": []},
            {"grammar": 'start: "q"'},
            {"grammar": "start: ??"},
            {"json": {"type": "object"}},
            {"json": "{not json"},
            {"json_object": True},
            {"regex": "a", "choice": ["b"]},
        ]
    ),
    "lora_name": st.sampled_from(["fz", "a/b", "", "test-model", "x" * 200]),
    "lora_path": st.sampled_from(["fz", "missing", "", "/etc", "../outside", "a\x00b"]),
}


VALID = {
    "/v1/completions": {"model": "test-model", "prompt": "hello", "max_tokens": 4},
    "/v1/chat/completions": {
        "model": "test-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    },
    "/v1/load_lora_adapter": {"lora_name": "fz", "lora_path": "fz"},
    "/v1/unload_lora_adapter": {"lora_name": "fz"},
    "/tokenize": {"model": "test-model", "prompt": "hello"},
    "/detokenize": {"model": "test-model", "tokens": [31, 32]},
}


def value(field: str) -> st.SearchStrategy[Any]:
    return GOOD_VALUES.get(field, json_values) | json_values


def bodies(route: str) -> st.SearchStrategy[Any]:
    """A valid body with one to three fields replaced (most reach the engine), a body of
    optional fields only, or any JSON value at all."""
    fields = [*FIELDS[route], "unknown_field"]
    changes = st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: value(k) for k in keys})
    )
    mutated = changes.map(lambda change: {**VALID[route], **change})
    loose = st.fixed_dictionaries({}, optional={f: value(f) for f in fields})
    return st.one_of(mutated, mutated, loose, json_values)


@pytest.fixture(scope="module")
def server(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThreadServer]:
    root = tmp_path_factory.mktemp("fuzz-lora-root")
    (root / "fz").mkdir()
    (root / "fz" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    s = start_thread_server(
        model_dirs["llama"], max_model_len=96, num_blocks=64, lora=LoraConfig(), lora_root=root
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def before(server: ThreadServer) -> str:
    return greedy(server)


def greedy(s: ThreadServer) -> str:
    r = httpx.post(f"{s.url}/v1/completions", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("route", list(FIELDS))
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_body_gets_2xx_or_4xx_never_5xx(
    server: ThreadServer, before: str, route: str, data: st.DataObject
) -> None:
    body = data.draw(bodies(route))
    raw = json.dumps(body)  # ASCII: lone surrogates and NUL travel as escapes
    check(httpx.post(f"{server.url}{route}", content=raw, headers=JSON, timeout=60))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_bytes_that_are_not_json_get_400(server: ThreadServer, raw: bytes) -> None:
    for route in FIELDS:
        check(httpx.post(f"{server.url}{route}", content=raw, headers=JSON, timeout=60))


def test_server_is_unchanged_after_the_fuzzing(server: ThreadServer, before: str) -> None:
    for path in ("/v1/models", "/metrics", "/health"):
        assert httpx.get(f"{server.url}{path}").status_code == 200
    assert server.engine.healthy and server.engine.dead is None
    assert greedy(server) == before
    engine = server.engine.engine
    wait_engine_drained(server)
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks  # no leaked block

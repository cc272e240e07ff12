"""Malformed and invalid requests over real HTTP: each gets a 4xx naming the problem, and the
server keeps serving with every KV block free again."""

from __future__ import annotations

import httpx
import pytest

from tests.serve.server_util import ThreadServer

BAD = [
    ("malformed JSON", b'{"model": "test-model", "prompt": "a",', 400, "not valid JSON"),
    ("body is a list", [1, 2], 400, "valid dictionary"),
    ("missing prompt", {"model": "test-model"}, 400, "missing required field 'prompt'"),
    (
        "unknown field",
        {"model": "test-model", "prompt": "a", "colour": 1},
        400,
        "unknown field 'colour'",
    ),
    ("wrong type", {"model": "test-model", "prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ("empty prompt", {"model": "test-model", "prompt": ""}, 400, "prompt is empty"),
    (
        "negative max_tokens",
        {"model": "test-model", "prompt": "a", "max_tokens": -1},
        400,
        "greater than or equal to 0",
    ),
    (
        "huge max_tokens",
        {"model": "test-model", "prompt": "a", "max_tokens": 10**9},
        400,
        "maximum context length is 512",
    ),
    (
        "prompt + max_tokens too long",
        {"model": "test-model", "prompt": list(range(6, 506)), "max_tokens": 20},
        400,
        "500 and max_tokens is 20",
    ),
    (
        "n zero",
        {"model": "test-model", "prompt": "a", "n": 0},
        400,
        "n: Input should be greater than or equal to 1",
    ),
    (
        "n too large",
        {"model": "test-model", "prompt": "a", "n": 99},
        400,
        "less than or equal to 16",
    ),
    ("top_p zero", {"model": "test-model", "prompt": "a", "top_p": 0}, 400, "top_p"),
    (
        "temperature negative",
        {"model": "test-model", "prompt": "a", "temperature": -0.5},
        400,
        "temperature",
    ),
    (
        "temperature too high",
        {"model": "test-model", "prompt": "a", "temperature": 9},
        400,
        "less than or equal to 2",
    ),
    ("unknown model", {"model": "gpt-5", "prompt": "a"}, 404, "model 'gpt-5' does not exist"),
    (
        "token id outside vocab",
        {"model": "test-model", "prompt": [5, 10**6]},
        400,
        "outside the vocabulary",
    ),
    (
        "too many stop strings",
        {"model": "test-model", "prompt": "a", "stop": list("abcde")},
        400,
        "at most 4 stop strings",
    ),
    ("logprobs over 5", {"model": "test-model", "prompt": "a", "logprobs": 9}, 400, "logprobs"),
    (
        "penalty out of range",
        {"model": "test-model", "prompt": "a", "presence_penalty": 2.5},
        400,
        "presence_penalty",
    ),
    (
        "logit_bias key not a token id",
        {"model": "test-model", "prompt": "a", "logit_bias": {"hello": 1}},
        400,
        "logit_bias keys are token ids",
    ),
    (
        "logit_bias token outside vocab",
        {"model": "test-model", "prompt": "a", "logit_bias": {"999999": 1}},
        400,
        "outside the vocabulary",
    ),
    (
        "logit_bias value too large",
        {"model": "test-model", "prompt": "a", "logit_bias": {"7": 101}},
        400,
        "[-100, 100]",
    ),
    (
        "stop_token_ids outside vocab",
        {"model": "test-model", "prompt": "a", "stop_token_ids": [10**7]},
        400,
        "outside the vocabulary",
    ),
    (
        "json schema the server cannot enforce",
        {
            "model": "test-model",
            "prompt": "a",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "if": {}, "then": {}}},
            },
        },
        400,
        "cannot be enforced",
    ),
    (
        "regex that does not parse",
        {"model": "test-model", "prompt": "a", "structured_outputs": {"regex": "a("}},
        400,
        "unclosed group",
    ),
    (
        "two structured constraints",
        {
            "model": "test-model",
            "prompt": "a",
            "structured_outputs": {"regex": "a", "choice": ["b"]},
        },
        400,
        "exactly one of",
    ),
    (
        "structured json string that is not JSON",
        {"model": "test-model", "prompt": "a", "structured_outputs": {"json": "{not json"}},
        400,
        "not JSON",
    ),
    (
        "min_tokens above max_tokens",
        {"model": "test-model", "prompt": "a", "min_tokens": 50, "max_tokens": 4},
        400,
        "min_tokens (50) is more than max_tokens (4)",
    ),
    (
        "too many prompts",
        {"model": "test-model", "prompt": [[5]] * 3000},
        400,
        "at most 2048",
    ),
    ("oversized body", {"model": "test-model", "prompt": "x" * (5 << 20)}, 413, "over the limit"),
]
BAD_CHAT = [
    ("no messages", {"model": "test-model", "messages": []}, 400, "at least 1 item"),
    (
        "bad role",
        {"model": "test-model", "messages": [{"role": "robot", "content": "hi"}]},
        400,
        "role",
    ),
    (
        "both max fields",
        {
            "model": "test-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "max_completion_tokens": 2,
        },
        400,
        "not both",
    ),
]


@pytest.mark.parametrize("case", BAD + BAD_CHAT, ids=[c[0] for c in BAD + BAD_CHAT])
def test_bad_request_gets_4xx_and_server_keeps_serving(server: ThreadServer, case: tuple) -> None:
    _, body, status, words = case
    path = "/v1/chat/completions" if case in BAD_CHAT else "/v1/completions"
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(
        f"{server.url}{path}", headers={"content-type": "application/json"}, timeout=60, **kwargs
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    good = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "test-model", "prompt": "a", "max_tokens": 2},
        timeout=60,
    )
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
    assert (
        server.engine.engine.scheduler.pool.num_free_blocks
        == server.engine.engine.runner.num_blocks
    )

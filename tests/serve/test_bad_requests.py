"""Malformed and invalid requests over real HTTP: each gets a 4xx naming the problem, and the
server keeps serving with every KV block free again."""

from __future__ import annotations

import json

import httpx
import pytest

from serve.http import completions
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


# --- issue 67.2: odd input that answered 500; every one is a 4xx naming the field ---

BASE = {"model": "test-model", "prompt": "a", "max_tokens": 2}


def refused(server: ThreadServer, body: dict, param: str, words: str, path: str = "") -> None:
    """`body` gets a 400 naming `param` and saying `words`, and the server serves on."""
    r = httpx.post(f"{server.url}{path or '/v1/completions'}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    good = httpx.post(f"{server.url}/v1/completions", json=BASE, timeout=60)
    assert good.status_code == 200, good.text


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_logit_bias_superscript_digit_key_is_400(server: ThreadServer) -> None:
    refused(server, {**BASE, "logit_bias": {"²": 1}}, "logit_bias", "ASCII digits")


def test_logit_bias_circled_digit_key_is_400(server: ThreadServer) -> None:
    refused(server, {**BASE, "logit_bias": {"①": 1}}, "logit_bias", "ASCII digits")


def test_logit_bias_5000_digit_key_is_400(server: ThreadServer) -> None:
    refused(server, {**BASE, "logit_bias": {"9" * 5000: 1}}, "logit_bias", "ASCII digits")


def test_logit_bias_key_outside_the_vocabulary_is_400_naming_it(server: ThreadServer) -> None:
    refused(server, {**BASE, "logit_bias": {"99999999": 1}}, "logit_bias", "[99999999] outside")
    chat = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    body = {**chat, "max_tokens": 2, "logit_bias": {"4096": 1}}
    refused(server, body, "logit_bias", "outside the vocabulary", "/v1/chat/completions")


def test_stop_token_ids_and_prompt_ids_outside_the_vocabulary_are_400_naming_them(
    server: ThreadServer,
) -> None:
    refused(server, {**BASE, "stop_token_ids": [10**9]}, "stop_token_ids", "outside")
    refused(server, {**BASE, "prompt": [11, 10**9]}, "prompt", "outside the vocabulary")
    refused(server, {**BASE, "prompt": [[11], [-1]]}, "prompt", "[-1] outside")


def test_response_format_schema_nested_350_deep_is_400(server: ThreadServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": nested_schema(350)}}
    refused(server, {**BASE, "response_format": fmt}, "response_format.json_schema.schema", "deep")


def test_structured_outputs_schema_nested_350_deep_is_400(server: ThreadServer) -> None:
    body = {**BASE, "structured_outputs": {"json": nested_schema(350)}}
    refused(server, body, "structured_outputs.json", "at most 128")


def test_structured_outputs_schema_string_of_100000_brackets_is_400(server: ThreadServer) -> None:
    body = {**BASE, "structured_outputs": {"json": "[" * 100_000}}
    refused(server, body, "structured_outputs.json", "100000 deep")
    body = {**BASE, "structured_outputs": {"json": json.dumps(nested_schema(200))}}
    refused(server, body, "structured_outputs.json", "deep")


def post_raw(server: ThreadServer, raw: str) -> httpx.Response:
    """POST a completions body as written (JSON the client library would not produce)."""
    return httpx.post(
        f"{server.url}/v1/completions",
        content=raw.encode(),
        headers={"content-type": "application/json"},
        timeout=60,
    )


def test_a_body_nested_deeper_than_the_parser_takes_is_400_unparsed(server: ThreadServer) -> None:
    schema = '{"type": "array", "items": ' * 5000 + '{"type": "string"}' + "}" * 5000
    raw = '{"model": "test-model", "prompt": "a", "structured_outputs": {"json": ' + schema + "}}"
    r = post_raw(server, raw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "body" and "5003 deep; at most 512" in error["message"], error


def test_regex_and_grammar_nested_past_the_bound_are_400(server: ThreadServer) -> None:
    regex = "(" * 2000 + "a" + ")" * 2000
    refused(
        server,
        {**BASE, "structured_outputs": {"regex": regex}},
        "structured_outputs.regex",
        "2000 deep",
    )
    lark = "start: " + "(" * 300 + '"a"' + ")" * 300
    refused(
        server,
        {**BASE, "structured_outputs": {"grammar": lark}},
        "structured_outputs.grammar",
        "300 deep",
    )


def test_a_schema_over_the_size_bound_is_400(server: ThreadServer) -> None:
    schema = {"type": "string", "description": "x" * (300 << 10)}
    body = {**BASE, "structured_outputs": {"json": schema}}
    refused(server, body, "structured_outputs.json", "at most 262144")


def test_a_schema_within_the_bounds_is_served(server: ThreadServer) -> None:
    body = {**BASE, "max_tokens": 4, "structured_outputs": {"json": nested_schema(40)}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith("[")


# --- issue 67.3: a body's shape is refused before any of it is tokenized ---


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ([1, "a" * ((4 << 20) - 200)], "prompt item 1 is a string but item 0 is a token id"),
        ([[1], "a" * ((4 << 20) - 200)], "item 1 is a string but item 0 is a token-id list"),
        (["a" * ((4 << 20) - 200), [1]], "item 1 is a token-id list but item 0 is a string"),
        ([[1, "a" * 1000]], "prompt item 0 holds a string"),
    ],
    ids=["token-id-then-4mib-string", "id-list-then-4mib-string", "string-then-ids", "ids-and-str"],
)
def test_prompt_list_of_a_token_id_and_a_4mib_string_is_refused_before_tokenizing(
    server: ThreadServer, monkeypatch: pytest.MonkeyPatch, prompt: list, words: str
) -> None:
    """Issue 67.3: a mixed prompt list must be refused by its shape, naming `prompt`, with
    nothing tokenized (tokenizing the 4 MiB string first is what cost seconds and gigabytes)."""
    encoded: list[int] = []
    real = completions.encode
    monkeypatch.setattr(
        completions,
        "encode",
        lambda tok, text, *a, **k: encoded.append(len(text)) or real(tok, text, *a, **k),
    )
    refused(server, {**BASE, "prompt": prompt}, "prompt", words)
    assert encoded == [1]  # only the text of the good request `refused` sends after it


@pytest.mark.parametrize("field", ["max_tokens", "seed", "prompt"])
def test_a_5000_digit_number_is_400_saying_so(server: ThreadServer, field: str) -> None:
    """A sibling of the 5,000-digit logit_bias key: as a JSON number, Python's parser refuses
    it and the answer named nothing ("There was an error parsing the body")."""
    number = "9" * 5000
    value = f"[{number}]" if field == "prompt" else number
    raw = '{"model": "test-model", "prompt": "a", "' + field + '": ' + value + "}"
    if field == "prompt":
        raw = '{"model": "test-model", "prompt": ' + value + "}"
    r = post_raw(server, raw)
    assert r.status_code == 400, r.text
    assert "a number of 5000 digits; at most 4300" in r.json()["error"]["message"]
    text = {"model": "test-model", "prompt": "9" * 6000, "max_tokens": 2}  # digits in a string
    r = httpx.post(f"{server.url}/v1/completions", json=text, timeout=60)
    assert r.json()["error"]["code"] == "context_length_exceeded"  # read, and tokenized

"""What clients written for vLLM or OpenAI use, over real HTTP against a running server:
streamed logprobs, logit_bias, structured outputs, /tokenize, /detokenize, /version, the model's
generation_config and --chat-template."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from serve import LLM, SamplingParams
from serve.core.config import CacheConfig
from tests.serve.conftest import Case
from tests.serve.server_util import ThreadServer, start_thread_server


@pytest.fixture(scope="module")
def offline(model_dirs: dict[str, Path]) -> LLM:
    return LLM(
        model_dirs["llama"], device="cpu", dtype="float32", cache=CacheConfig(num_blocks=512)
    )


def test_streamed_completion_logprobs_equal_the_whole_answer(
    client: openai.OpenAI, cases: list[Case]
) -> None:
    prompt = cases[3].prompt[:40]
    kwargs = {"model": "test-model", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**kwargs, logprobs=3).choices[0]
    tokens, token_logprobs, tops, offsets, text = [], [], [], [], ""
    for chunk in client.completions.create(**kwargs, logprobs=3, stream=True):
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            token_logprobs += choice.logprobs.token_logprobs
            tops += choice.logprobs.top_logprobs
            offsets += choice.logprobs.text_offset
    assert whole.logprobs is not None
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert token_logprobs == whole.logprobs.token_logprobs and tops == whole.logprobs.top_logprobs
    assert offsets == whole.logprobs.text_offset


def test_streamed_chat_logprobs_equal_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs = {
        "model": "test-model",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed, text = [], ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
    assert whole.logprobs is not None and whole.logprobs.content
    assert text == whole.message.content
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in whole.logprobs.content]


def test_logit_bias_through_the_openai_client(
    client: openai.OpenAI, model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    out = client.completions.create(
        model="test-model",
        prompt=cases[2].prompt[:30],
        max_tokens=5,
        temperature=1.0,
        logit_bias={"42": 100},
        logprobs=0,
    )
    forced = AutoTokenizer.from_pretrained(model_dirs["llama"]).decode([42])
    assert out.choices[0].logprobs is not None
    assert out.choices[0].logprobs.tokens == [forced] * 5


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        },
        "required": ["colour", "ok", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            },
            "label": {"type": ["string", "null"], "maxLength": 8},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
]


def test_50_json_schema_requests_are_all_valid_under_their_schema(server: ThreadServer) -> None:
    """The issue's target: 100% of 50 sampled (temperature 1) requests on the random model
    parse and validate, with unconstrained requests in the same batches."""
    rng = random.Random(0)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[dict, str, str | None]:
        schema = SCHEMAS[i % len(SCHEMAS)]
        out = await client.chat.completions.create(
            model="test-model",
            messages=[{"role": "user", "content": f"Give me JSON number {i}."}],
            max_tokens=120,
            temperature=1.0,
            seed=rng.randrange(1000),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"s{i % 3}", "schema": schema, "strict": True},
            },
        )
        choice = out.choices[0]
        return schema, choice.message.content or "", choice.finish_reason

    async def free(client: openai.AsyncOpenAI) -> str:
        out = await client.completions.create(model="test-model", prompt="a b", max_tokens=30)
        return out.choices[0].finish_reason

    async def run() -> tuple[list, list]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        constrained = asyncio.gather(*(one(client, i) for i in range(50)))
        unconstrained = asyncio.gather(*(free(client) for _ in range(10)))
        return list(await constrained), list(await unconstrained)

    answers, free_reasons = asyncio.run(run())
    for schema, text, reason in answers:
        assert reason == "stop", text
        answer = json.loads(text)
        jsonschema.validate(answer, schema)
        assert list(answer) == list(schema["properties"])  # the schema's order, not sorted
    assert all(r in ("stop", "length") for r in free_reasons)


def test_json_object_choice_regex_and_lark(client: openai.OpenAI) -> None:
    base = {"model": "test-model", "prompt": "x", "max_tokens": 60, "temperature": 1.0}
    for seed in range(3):
        obj = client.completions.create(
            **base, seed=seed, extra_body={"response_format": {"type": "json_object"}}
        )
        assert isinstance(json.loads(obj.choices[0].text), dict)
        choice = client.completions.create(
            **base, seed=seed, extra_body={"structured_outputs": {"choice": ["Paris", "Lyon ü"]}}
        )
        assert choice.choices[0].text in ("Paris", "Lyon ü")
        regex = client.completions.create(
            **base, seed=seed, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}
        )
        text = regex.choices[0].text
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
        lark = client.completions.create(
            **base,
            seed=seed,
            extra_body={"structured_outputs": {"grammar": 'start: "yes" | "no" " " /[0-9]/'}},
        )
        assert lark.choices[0].text == "yes" or lark.choices[0].text[:3] == "no "


def test_constrained_request_beside_a_free_one_leaves_the_free_one_exact(
    server: ThreadServer, offline: LLM, cases: list[Case]
) -> None:
    prompt = cases[5].prompt[:50]
    expected = offline.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            body = {"model": "test-model", "max_tokens": 20, "temperature": 0}
            return await asyncio.gather(
                c.post("/v1/completions", json={**body, "prompt": prompt}),
                *(
                    c.post(
                        "/v1/completions",
                        json={
                            **body,
                            "prompt": "z",
                            "response_format": {"type": "json_object"},
                        },
                    )
                    for _ in range(3)
                ),
            )

    free, *constrained = asyncio.run(run())
    assert free.json()["choices"][0]["text"] == expected.text
    assert all(r.status_code == 200 for r in constrained)


def test_tokenize_and_detokenize_round_trip(
    server: ThreadServer, model_dirs: dict[str, Path]
) -> None:
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    text = "The capital of France is"
    r = httpx.post(f"{server.url}/tokenize", json={"model": "test-model", "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok(text).input_ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] is None
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]})
    assert back.json()["prompt"] == tok.decode(body["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages})
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat.json()["tokens"] == tok(rendered, add_special_tokens=False).input_ids
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**8]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    neither = httpx.post(f"{server.url}/tokenize", json={"model": "test-model"})
    assert neither.status_code == 400 and "exactly one of" in neither.json()["error"]["message"]


def test_version_says_what_the_server_supports(server: ThreadServer) -> None:
    body = httpx.get(f"{server.url}/version").json()
    assert body["version"]
    features = body["features"]
    assert features["structured_outputs"]["backend"].startswith("xgrammar ")
    assert features["structured_outputs"]["fallback"].startswith("llguidance ")
    assert "json_schema" in features["structured_outputs"]["kinds"]
    assert {"logit_bias", "min_p", "repetition_penalty"} <= set(features["sampling"])
    assert features["logprobs"]["streamed"] is True


def _with_generation_config(src: Path, dst: Path, config: dict) -> Path:
    shutil.copytree(src, dst)
    current = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**current, **config}))
    return dst


def test_generation_config_eos_ids_and_defaults_apply(
    model_dirs: dict[str, Path], offline: LLM, cases: list[Case], tmp_path: Path
) -> None:
    prompt = cases[3].prompt[:40]
    plain = offline.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    eos = offline.engine.tokenizer.eos_token_id
    model = _with_generation_config(
        model_dirs["llama"],
        tmp_path / "model",
        {"eos_token_id": [eos, plain[3]], "max_new_tokens": 6, "top_k": 1},
    )
    s = start_thread_server(model)
    vllm_defaults = start_thread_server(model, generation_config="vllm")
    try:
        body = {"model": "test-model", "prompt": prompt, "temperature": 0}
        stopped = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["usage"]["completion_tokens"] == 4  # the generation config's second EOS
        short = httpx.post(
            f"{s.url}/v1/completions", json={**body, "prompt": [5, 6, 7]}, timeout=60
        ).json()
        assert short["usage"]["completion_tokens"] <= 6  # max_new_tokens as the default
        sampled = httpx.post(
            f"{s.url}/v1/completions",
            json={**body, "temperature": 1.0, "seed": 5, "max_tokens": 3},
            timeout=60,
        ).json()
        assert sampled["choices"][0]["text"] == offline.engine.tokenizer.decode(plain[:3])
        ignored = httpx.post(
            f"{vllm_defaults.url}/v1/completions", json={**body, "max_tokens": 8}, timeout=60
        ).json()
        assert ignored["usage"]["completion_tokens"] == 8
        version = httpx.get(f"{s.url}/version").json()
        assert version["features"]["generation_config_defaults"] == {"max_tokens": 6, "top_k": 1}
    finally:
        s.stop()
        vllm_defaults.stop()


def test_chat_template_flag_replaces_the_models(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<<assistant>>{% endif %}"
    )
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    s = start_thread_server(model_dirs["llama"], chat_template=str(template))
    try:
        messages = [{"role": "user", "content": "hello there"}]
        r = httpx.post(f"{s.url}/tokenize", json={"messages": messages}).json()
        expected = tok("<<user>> hello there\n<<assistant>>", add_special_tokens=False).input_ids
        assert r["tokens"] == expected
        chat = httpx.post(
            f"{s.url}/v1/chat/completions",
            json={"model": "test-model", "messages": messages, "max_tokens": 2},
            timeout=60,
        ).json()
        assert chat["usage"]["prompt_tokens"] == len(expected)
    finally:
        s.stop()

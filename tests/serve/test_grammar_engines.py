"""Which engine enforces a grammar, and that what each engine's masks admit is valid: random
walks through the masks (any allowed token, to the end) on the tiny demo tokenizer, each text
validated against its schema."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from serve.core.sampling_params import Grammar
from serve.model.grammar import GrammarBackend
from serve.model.grammar_engines import ANNOTATIONS, XGRAMMAR_KEYWORDS, GrammarError, route
from serve.model.greedy import unpack_allowed

STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
OBJECT = {"type": "object", "additionalProperties": False}

# Every keyword xgrammar is trusted with, each in a schema whose masks are walked below.
XGRAMMAR_SCHEMAS: list[dict[str, Any]] = [
    {
        **OBJECT,
        "title": "person",
        "description": "annotations change nothing",
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "properties": {
            "name": {"type": "string", "default": "ab"},
            "age": {"type": "integer", "minimum": 3, "maximum": 40, "examples": [7]},
            "score": {"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 2.5},
        },
        "required": ["name", "age", "score"],
    },
    {
        **OBJECT,
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", 3]},
                "minItems": 1,
                "maxItems": 3,
            },
            "pair": {"type": "array", "prefixItems": [{"const": "x"}, {"type": "boolean"}]},
            "label": {"type": ["string", "null"]},
        },
        "required": ["tags", "pair", "label"],
    },
    {
        "$defs": {"leaf": {**OBJECT, "properties": {"v": {"type": "integer"}}, "required": ["v"]}},
        "definitions": {"name": {"type": "string"}},
        "anyOf": [{"$ref": "#/$defs/leaf"}, {"$ref": "#/definitions/name"}, {"type": "null"}],
    },
    {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "additionalProperties": {"type": "integer"},
    },
]

# Keywords xgrammar would ignore or approximate: these go to llguidance, which enforces them or
# refuses them naming the construct.
LLGUIDANCE_SCHEMAS: list[dict[str, Any]] = [
    {"type": "string", "maxLength": 4},  # xgrammar's bounded strings admit control characters
    {"type": "string", "pattern": "^[a-z]{2}$"},
    {"type": "string", "format": "date"},
    {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
    {"$ref": "https://example.com/schema.json"},
    {
        **OBJECT,
        "properties": {"deep": {"type": "array", "items": {"type": "string", "pattern": "a"}}},
    },
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def backend(tokenizer: PreTrainedTokenizerBase) -> GrammarBackend:
    return GrammarBackend(tokenizer, len(tokenizer) + 3, [tokenizer.eos_token_id])


def allowed_tokens(backend: GrammarBackend, request_ids: list[str]) -> dict[str, list[int]]:
    """One step's masks as each request's allowed token ids."""
    masks = backend._masks(request_ids)
    allowed = unpack_allowed(masks.aligned(request_ids), backend.vocab_size)
    return {r: row.nonzero().flatten().tolist() for r, row in zip(request_ids, allowed)}


def walk_all(
    backend: GrammarBackend, grammars: dict[str, Grammar], seed: int, max_steps: int = 200
) -> dict[str, list[int]]:
    """Every request takes random allowed tokens, all in the same mask and consume calls, until
    it takes end-of-sequence: {request id: its tokens before it}. After 40 tokens a walk heads
    for the end (end-of-sequence, else a token that closes something), so unbounded schemas end."""
    rng = random.Random(seed)
    tokenizer = backend.hf_tokenizer
    for request_id, grammar in grammars.items():
        backend.add(request_id, grammar)
    texts: dict[str, list[int]] = {r: [] for r in grammars}
    running = list(grammars)

    def pick(allowed: list[int], steps: int) -> int:
        if steps >= 40:
            ending = [t for t in allowed if t in backend.eos_ids] or [
                t for t in allowed if any(c in tokenizer.decode([t]) for c in '}]"')
            ]
            allowed = ending or allowed
        return rng.choice(allowed)

    for step in range(max_steps):
        masks = allowed_tokens(backend, running)
        picks = {r: pick(masks[r], step) for r in running}
        backend.consume(picks)
        for r, token in picks.items():
            if token in backend.eos_ids:
                running.remove(r)
            else:
                texts[r].append(token)
        if not running:
            return texts
    raise AssertionError(f"{running} did not end in {max_steps} tokens")


def test_schemas_with_only_enforced_keywords_go_to_xgrammar() -> None:
    for schema in XGRAMMAR_SCHEMAS:
        assert route(Grammar("json_schema", json.dumps(schema))).engine == "xgrammar", schema
    for kind, spec in (("json_object", ""), ("regex", "[0-9]{2}"), ("choice", '["a", "b"]')):
        assert route(Grammar(kind, spec)).engine == "xgrammar"
    used = {k for s in XGRAMMAR_SCHEMAS for k in _keywords(s)}
    assert used >= XGRAMMAR_KEYWORDS - ANNOTATIONS, "a trusted keyword no walk exercises"


def test_other_keywords_and_lark_go_to_llguidance() -> None:
    for schema in LLGUIDANCE_SCHEMAS:
        try:
            assert route(Grammar("json_schema", json.dumps(schema))).engine == "llguidance"
        except GrammarError as e:  # llguidance refuses it: a 400 naming the construct
            assert "cannot be enforced" in str(e) or "not valid" in str(e)
    assert route(Grammar("lark", 'start: "a" | "b"')).engine == "llguidance"
    with pytest.raises(GrammarError, match=r"cannot be enforced|not valid"):
        route(Grammar("json_schema", json.dumps({"type": "object", "if": {}, "then": {}})))


def test_every_text_xgrammar_masks_admit_validates_under_its_schema(
    backend: GrammarBackend, tokenizer: PreTrainedTokenizerBase
) -> None:
    grammars = {
        f"s{i}-{k}": Grammar("json_schema", json.dumps(s))
        for i, s in enumerate(XGRAMMAR_SCHEMAS)
        for k in range(6)
    }
    for seed in range(3):
        texts = walk_all(backend, grammars, seed)
        for request_id, tokens in texts.items():
            schema = XGRAMMAR_SCHEMAS[int(request_id[1 : request_id.index("-")])]
            text = tokenizer.decode(tokens)
            jsonschema.validate(json.loads(text), schema)
            assert not re.search(r"\s", STRING.sub('""', text)), text  # compact
            backend.release(request_id)
        assert not backend.matchers and not backend.ended


def test_one_batch_mixes_both_engines(
    backend: GrammarBackend, tokenizer: PreTrainedTokenizerBase
) -> None:
    """xgrammar's batched rows and llguidance's rows in the same mask and consume calls."""
    pattern = {"type": "string", "pattern": "^[a-c]{2,3}$"}
    grammars = {
        "choice": Grammar("choice", json.dumps(["Paris", "Lyon ü", 'q"x'])),
        "regex": Grammar("regex", "[0-9]{3}-[a-z]{2}"),
        "lark": Grammar("lark", 'start: "yes" | "no" " " /[0-9]/'),
        "pattern": Grammar("json_schema", json.dumps(pattern)),
        "object": Grammar("json_object"),
    }
    assert {r: route(g).engine for r, g in grammars.items()} == {
        "choice": "xgrammar",
        "regex": "xgrammar",
        "lark": "llguidance",
        "pattern": "llguidance",
        "object": "xgrammar",
    }
    for seed in range(4):
        texts = {r: tokenizer.decode(t) for r, t in walk_all(backend, grammars, seed).items()}
        assert texts["choice"] in ("Paris", "Lyon ü", 'q"x')
        regex = texts["regex"]
        assert len(regex) == 6 and regex[:3].isdigit() and regex[3] == "-" and regex[4:].isalpha()
        assert texts["lark"] == "yes" or (texts["lark"][:3] == "no " and texts["lark"][3].isdigit())
        jsonschema.validate(json.loads(texts["pattern"]), pattern)
        assert isinstance(json.loads(texts["object"]), dict)
        for r in grammars:
            backend.release(r)


def test_both_engines_write_the_same_compact_json(
    backend: GrammarBackend, tokenizer: PreTrainedTokenizerBase
) -> None:
    fixed = {
        **OBJECT,
        "properties": {"a": {"const": 1}, "b": {"enum": [[True, None]]}, "c": {"const": "x y"}},
        "required": ["a", "b", "c"],
    }
    fast = Grammar("json_schema", json.dumps(fixed))
    slow = Grammar(
        "json_schema",
        json.dumps({**fixed, "properties": {**fixed["properties"], "d": {"pattern": "z"}}}),
    )
    assert route(fast).engine == "xgrammar" and route(slow).engine == "llguidance"
    texts = walk_all(backend, {"fast": fast, "slow": slow}, seed=0)
    assert tokenizer.decode(texts["fast"]) == '{"a":1,"b":[true,null],"c":"x y"}'
    assert tokenizer.decode(texts["slow"]).startswith('{"a":1,"b":[true,null],"c":"x y"')


def test_a_matcher_that_ended_or_rejected_a_token_allows_only_end_of_sequence(
    backend: GrammarBackend, tokenizer: PreTrainedTokenizerBase
) -> None:
    eos = tokenizer.eos_token_id
    backend.add("done", Grammar("choice", '["ab"]'))
    backend.add("rejected", Grammar("regex", "[0-9]+"))
    for token in tokenizer.encode("ab", add_special_tokens=False):
        backend.consume({"done": token})
    backend.consume({"done": eos, "rejected": tokenizer.encode("z", add_special_tokens=False)[0]})
    masks = allowed_tokens(backend, ["done", "rejected", "free"])
    assert masks["done"] == masks["rejected"] == [eos]
    assert masks["free"] == list(range(backend.vocab_size))
    assert backend.ended == {"done", "rejected"}


def _keywords(schema: Any) -> set[str]:
    if isinstance(schema, list):
        return set().union(*map(_keywords, schema)) if schema else set()
    if not isinstance(schema, dict):
        return set()
    found = set(schema)
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions"):
            found |= _keywords(list(value.values()))
        elif key in ("anyOf", "prefixItems", "items", "additionalProperties"):
            found |= _keywords(value)
    return found


def test_an_engine_batch_of_every_sampling_path_under_grammars(tiny_model_dir: Path) -> None:
    """One batch: greedy rows masked in the argmax kernel (xgrammar and llguidance), a greedy
    row whose logits are also processed (repetition penalty: the bitmask unpacked for it), a
    sampled row, and a free greedy row that stays as it is alone."""
    from serve.core.sampling_params import SamplingParams
    from serve.engine.llm import LLM

    llm = LLM(tiny_model_dir)
    schema = {  # bounded, so a greedy answer ends
        **OBJECT,
        "properties": {
            "age": {"type": "integer", "minimum": 3, "maximum": 40},
            "ok": {"type": "boolean"},
            "tag": {"enum": ["a", "b"]},
        },
        "required": ["age", "ok", "tag"],
    }
    lark = Grammar("lark", 'start: "yes" | "no" " " /[0-9]/')
    as_json = Grammar("json_schema", json.dumps(schema))
    free = SamplingParams(max_tokens=24, temperature=0)
    params = [
        SamplingParams(max_tokens=200, temperature=0, grammar=as_json),
        SamplingParams(max_tokens=20, temperature=0, grammar=lark),
        SamplingParams(max_tokens=200, temperature=0, grammar=as_json, repetition_penalty=1.3),
        SamplingParams(
            max_tokens=20, temperature=1.0, seed=3, grammar=Grammar("regex", "[a-c]{4}")
        ),
        free,
    ]
    prompts = ["Person as JSON:", "Yes or no?", "Again as JSON:", "Four letters:", "the river"]
    out = llm.generate(prompts, params)
    for i in (0, 2):
        assert out[i].finish_reason == "stop"
        jsonschema.validate(json.loads(out[i].text), schema)
    assert out[1].text == "yes" or (out[1].text[:3] == "no " and out[1].text[3].isdigit())
    assert len(out[3].text) == 4 and set(out[3].text) <= set("abc")
    assert out[4].token_ids == llm.generate(["the river"], free)[0].token_ids


def test_an_end_of_sequence_id_outside_the_vocabulary_is_left_out(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """GPT-2's config names 50256 as end-of-sequence on a model of 512 tokens: the backend (built
    with every engine) starts, and an ended matcher allows the id the vocabulary has."""
    eos = tokenizer.eos_token_id
    backend = GrammarBackend(tokenizer, len(tokenizer), [50_256, eos])
    assert backend.eos_ids == [eos]
    backend.add("done", Grammar("choice", '["ab"]'))
    for token in [*tokenizer.encode("ab", add_special_tokens=False), eos]:
        backend.consume({"done": token})
    assert allowed_tokens(backend, ["done"]) == {"done": [eos]}


def test_a_rejected_token_leaves_the_matcher_as_it_was(
    backend: GrammarBackend, tokenizer: PreTrainedTokenizerBase
) -> None:
    """What deferred masks rely on, over every token at every step of random walks: xgrammar
    accepts a token exactly when its mask allows it, and offering a rejected one changes
    nothing (the deferred request then gets the same mask, and its next one up front)."""
    rng = random.Random(0)
    grammars = [Grammar("json_schema", json.dumps(s)) for s in XGRAMMAR_SCHEMAS[:2]]
    grammars += [Grammar("regex", "[0-9]{2}-[a-z]+"), Grammar("json_object")]
    for k, grammar in enumerate(grammars):
        request_id = f"r{k}"
        backend.add(request_id, grammar, deferrable=True)
        matcher = backend.matchers[request_id]
        for _ in range(30):
            allowed = allowed_tokens(backend, [request_id])[request_id]
            accepted = [t for t in range(backend.vocab_size) if matcher.fork().accept_token(t)]
            assert accepted == allowed
            rejected = sorted(set(range(backend.vocab_size)) - set(allowed))
            assert backend.start_masks([request_id]) is None  # deferred
            assert backend.consume({request_id: rng.choice(rejected)}) == [request_id]
            again = backend.masks_now([request_id])
            assert (
                unpack_allowed(again.words, backend.vocab_size)[0].nonzero().flatten().tolist()
                == allowed
            )
            token = rng.choice(allowed)
            assert backend.consume({request_id: token}) == []
            if token in backend.eos_ids:
                break
            assert backend.start_masks([request_id]) is not None  # up front after a rejection
            assert (
                backend.consume(
                    {request_id: rng.choice(allowed_tokens(backend, [request_id])[request_id])}
                )
                == []
            )
            if backend.matchers[request_id].is_terminated():
                break
        backend.release(request_id)
    assert backend.counts["rejected"] > 0 and not backend.up_front


def test_deferred_masks_give_the_tokens_and_logprobs_of_masks_up_front(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy constrained requests in one batch, whose free argmax the grammar sometimes takes
    and sometimes rejects: the same tokens and logprobs as with every mask computed first."""
    from serve.core.sampling_params import SamplingParams
    from serve.engine.llm import LLM

    grammars = [
        Grammar("json_schema", json.dumps(XGRAMMAR_SCHEMAS[0])),
        Grammar("json_schema", json.dumps(XGRAMMAR_SCHEMAS[1])),
        Grammar("regex", "[0-9]{3}-[a-z ]{2,12}"),
        Grammar("json_object"),
        Grammar("choice", json.dumps(["Paris", "Lyon", "a river"])),
    ]
    params = [SamplingParams(max_tokens=40, temperature=0, logprobs=2, grammar=g) for g in grammars]
    prompts = ["Person as JSON:", "Tags:", "Code:", "Anything:", "City:"]
    deferred = LLM(tiny_model_dir)
    first = deferred.generate(prompts, params)
    counts = deferred.engine.grammars.counts
    assert counts["deferred"] > counts["rejected"] > 0  # both paths taken

    up_front = LLM(tiny_model_dir)
    backend = up_front.engine.grammars
    add = backend.add
    monkeypatch.setattr(backend, "add", lambda r, g, deferrable=False: add(r, g, False))
    second = up_front.generate(prompts, params)
    assert backend.counts["deferred"] == 0
    for a, b in zip(first, second):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.logprobs == b.logprobs

"""Bounds on the shape and size of what a client sends (bodies, schemas, grammars, prompt
lists), checked without recursion before anything recurses over it: Python's JSON parser,
pydantic, the schema walkers and the grammar compilers each recurse once per level (a body or a
schema string nested 100,000 deep raised RecursionError, a 500)."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from serve.core.sampling_params import MAX_GRAMMAR_CHARS

MAX_SCHEMA_DEPTH = 128
"""Nesting of a JSON schema's objects and arrays (each level of `items` is one, of
`properties` two); what the grammar engines take (llguidance refuses less), and far above what
real schemas use (OpenAI's strict mode allows 10 levels of objects)."""
MAX_JSON_DEPTH = 4 * MAX_SCHEMA_DEPTH
"""Nesting of JSON arrays and objects in a whole body (refused unparsed by the middleware):
deep enough that a too-deep schema reaches its field's check, which names it."""
MAX_GRAMMAR_DEPTH = MAX_SCHEMA_DEPTH
"""Nesting of parentheses, brackets and braces in a regex or Lark grammar (a bound counted on
the raw text, escapes included: their parsers recurse per level)."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: linear, runs in C


MAX_INTEGER_DIGITS = 4300
"""Digits of a JSON number outside strings: Python's limit for converting a string to an int
(`sys.get_int_max_str_digits`; a longer integer made the body "not parseable", naming nothing)."""
_DIGITS = re.compile(rb"[0-9]{%d,}" % (MAX_INTEGER_DIGITS + 1))


def longest_integer(body: bytes) -> int:
    """The longest run of digits outside JSON strings, when it is over `MAX_INTEGER_DIGITS`
    (else 0)."""
    if len(body) <= MAX_INTEGER_DIGITS or _DIGITS.search(body) is None:
        return 0
    return max((len(m) for m in _DIGITS.findall(strip_strings(body))), default=0)


def strip_strings(body: bytes) -> bytes:
    """`body` without its JSON strings (so brackets inside them are not counted)."""
    return _STRING.sub(b"", body)


def bracket_depth(text: bytes, opens: bytes = b"[{", closes: bytes = b"]}") -> int:
    """The deepest nesting of `opens` / `closes` in `text` (a bound, not a parse: unbalanced
    text is left to its parser). Linear, in C."""
    if sum(text.count(bytes([b])) for b in opens) == 0:
        return 0
    kept = text.translate(None, bytes(sorted(set(range(256)) - set(opens + closes))))
    codes = np.frombuffer(kept, dtype=np.uint8)
    steps = np.isin(codes, list(opens)).astype(np.int32) - np.isin(codes, list(closes))
    return int(np.cumsum(steps).max())


def json_depth(body: bytes) -> int:
    """The deepest nesting of JSON arrays and objects in `body`, outside strings."""
    return bracket_depth(strip_strings(body))


def nesting_depth(value: Any, bound: int) -> int:
    """The nesting depth of lists and dicts in a parsed JSON value (a scalar is 0, `[]` is 1),
    counted level by level without recursion; stops counting past `bound`."""
    depth, level = 0, [value]
    while depth <= bound:
        containers = [v for v in level if isinstance(v, list | dict)]
        if not containers:
            return depth
        depth += 1
        level = [c for v in containers for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def check_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema within `MAX_SCHEMA_DEPTH` and `MAX_GRAMMAR_CHARS`, else ValueError saying so
    (depth first: measuring the size serializes it, which recurses)."""
    if (depth := nesting_depth(schema, MAX_SCHEMA_DEPTH)) > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"the schema nests objects and arrays more than {depth - 1} deep; at most "
            f"{MAX_SCHEMA_DEPTH}: flatten it (use $defs and $ref for recursive shapes)"
        )
    check_grammar_size(json.dumps(schema), "the schema")
    return schema


def check_grammar_size(text: str, what: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(
            f"{what} is {len(text)} characters; at most {MAX_GRAMMAR_CHARS}: shorten it "
            "(long descriptions do not constrain the output: drop them)"
        )
    return text


def check_grammar_text(text: str, what: str) -> str:
    """A regex or Lark grammar within the size and nesting bounds, else ValueError."""
    check_grammar_size(text, what)
    depth = bracket_depth(text.encode("utf-8", "replace"), b"([{", b")]}")
    if depth > MAX_GRAMMAR_DEPTH:
        raise ValueError(
            f"{what} nests parentheses and brackets {depth} deep; at most {MAX_GRAMMAR_DEPTH}"
        )
    return text


PROMPT_SHAPES = "a string, a list of token ids, a list of strings, or a list of token-id lists"


def _kind(item: Any) -> str:
    if isinstance(item, list):
        return "token-id list"
    return {str: "string", int: "token id"}.get(type(item), type(item).__name__)


def prompt_shape_problem(value: Any) -> str | None:
    """What breaks a prompt's shape (one kind of item per list), or None when its shape is
    one of `PROMPT_SHAPES` (whatever else is wrong with it)."""
    if isinstance(value, str):
        return None
    if not isinstance(value, list):
        return f"prompt must be {PROMPT_SHAPES}; got a {_kind(value)}"
    kinds = [_kind(item) for item in value[:1]]
    if kinds and kinds[0] not in ("string", "token id", "token-id list"):
        return f"prompt must be {PROMPT_SHAPES}; item 0 is a {kinds[0]}"
    for i, item in enumerate(value):
        if _kind(item) != kinds[0]:
            return (
                f"prompt item {i} is a {_kind(item)} but item 0 is a {kinds[0]}: a prompt "
                f"list holds one kind; send {PROMPT_SHAPES}"
            )
        if (
            isinstance(item, list)
            and (bad := next((x for x in item if _kind(x) != "token id"), None)) is not None
        ):
            return f"prompt item {i} holds a {_kind(bad)}; a token-id list holds token ids only"
    return None

"""Which grammar engine enforces a constraint, and the constraint in that engine's terms.

Model (vLLM's `auto` structured-output backend, with a stricter rule for when to leave the fast
engine): xgrammar enforces JSON schemas, JSON objects, regexes and choices when it enforces them
*exactly*; llguidance enforces the rest (Lark grammars; schemas using a keyword outside
`XGRAMMAR_KEYWORDS`) or refuses them with an error naming the construct. xgrammar precomputes the
tokens each grammar state allows whatever the context, so a step's masks cost a fraction of
llguidance's (16 JSON requests: 0.08-0.10 against 0.45-0.88 ms a step on a 2-core CPU), but it
silently ignores schema keywords it does not implement (`if`/`then`, `not`, `uniqueItems`,
`patternProperties`, ...), so a schema goes to it only when every keyword in it is one it is
known to enforce; anything else goes to llguidance, which refuses what it cannot honour.

Both engines emit the same JSON: compact, no whitespace between tokens (a model cannot spend
its tokens on blank lines), properties in the schema's order.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from serve.core.sampling_params import Grammar

JSON_OPTIONS = {"whitespace_flexible": False}
"""llguidance's JSON: compact."""
JSON_SEPARATORS = (",", ":")
"""xgrammar's JSON: compact, as llguidance's."""

ANNOTATIONS = frozenset(
    {"title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated"}
    | {"readOnly", "writeOnly"}
)
"""Keywords that never change which documents a schema accepts."""
XGRAMMAR_KEYWORDS = ANNOTATIONS | frozenset(
    {"type", "enum", "const", "anyOf", "$ref", "$defs", "definitions"}
    | {"properties", "required", "additionalProperties"}
    | {"items", "prefixItems", "minItems", "maxItems"}
    | {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
)
"""The JSON-schema keywords xgrammar enforces exactly (each pinned by a test that walks its
masks and validates what they admit). Left out: `minLength` / `maxLength` (xgrammar 0.2.9's
length-bounded strings admit raw control characters: invalid JSON), `pattern` and `format` (ECMA
regex and format semantics), `oneOf` and `allOf` (xgrammar approximates them)."""
SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
SUBSCHEMA_LISTS = ("anyOf", "prefixItems")


class GrammarError(ValueError):
    """A grammar this server cannot honour; the message names the construct."""


@dataclass(frozen=True)
class Route:
    """How one grammar is enforced: `engine` "xgrammar" with `source` its (kind, text)
    (kind json / regex / ebnf), or "llguidance" with `source` ("lark", llguidance's grammar)."""

    engine: str
    source: tuple[str, str]


def xgrammar_enforces(schema: Any) -> bool:
    """Whether every keyword of `schema` and of its subschemas is one xgrammar enforces."""
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict) or not set(schema) <= XGRAMMAR_KEYWORDS:
        return False
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        return False  # only references inside the schema
    subschemas: list[Any] = []
    for key in SUBSCHEMA_MAPS:
        value = schema.get(key, {})
        if not isinstance(value, dict):
            return False
        subschemas += value.values()
    for key in SUBSCHEMA_LISTS:
        value = schema.get(key, [])
        if not isinstance(value, list):
            return False
        subschemas += value
    for key in ("items", "additionalProperties"):
        if key in schema:
            subschemas.append(schema[key])
    return all(xgrammar_enforces(s) for s in subschemas)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise GrammarError("structured output needs the xgrammar package") from e
    return xgrammar


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise GrammarError("structured output needs the llguidance package") from e
    return llguidance


def alternatives(choices: list[str]) -> str:
    """Literal strings as one rule's alternatives, in the JSON string syntax both xgrammar's EBNF
    and llguidance's Lark read."""
    return " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _xgrammar_source(grammar: Grammar) -> tuple[str, str] | None:
    """The grammar in xgrammar's terms, or None when xgrammar would not enforce it exactly."""
    kind, spec = grammar.kind, grammar.spec
    if kind == "json_object":
        return "json", json.dumps({"type": "object"})
    if kind == "json_schema":
        return ("json", spec) if xgrammar_enforces(json.loads(spec)) else None
    if kind == "regex":
        return "regex", spec
    if kind == "choice":
        return "ebnf", f"root ::= {alternatives(json.loads(spec))}"
    return None  # Lark: llguidance's dialect


def _xgrammar_checks(source: tuple[str, str]) -> bool:
    """Whether xgrammar parses `source` (a tokenizer-free compile)."""
    xgr = _xgrammar()
    kind, text = source
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        else:
            xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError):
        return False
    return True


class RouteCache:
    """Routes by grammar, least recently used evicted, bounded by the characters they hold
    (a grammar's spec and its engine's text): a bound on entries alone let 256 large schemas
    hold hundreds of megabytes. Thread-safe (the HTTP workers and the grammar worker share it)."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars, self.chars = max_chars, 0
        self._routes: OrderedDict[Grammar, Route] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def size(grammar: Grammar, chosen: Route) -> int:
        return len(grammar.spec) + len(chosen.source[1])

    def get(self, grammar: Grammar) -> Route | None:
        with self._lock:
            chosen = self._routes.get(grammar)
            if chosen is not None:
                self._routes.move_to_end(grammar)
            return chosen

    def put(self, grammar: Grammar, chosen: Route) -> None:
        with self._lock:
            if grammar in self._routes:
                return
            self._routes[grammar] = chosen
            self.chars += self.size(grammar, chosen)
            while self.chars > self.max_chars and len(self._routes) > 1:
                old, gone = self._routes.popitem(last=False)
                self.chars -= self.size(old, gone)


ROUTES = RouteCache(64 << 20)
"""The routes of recent grammars: 64M characters at most."""


def route(grammar: Grammar) -> Route:
    """The engine that enforces `grammar`, checked; raises `GrammarError` naming the problem
    when neither can. Cached (`ROUTES`): the HTTP layer checks each request's grammar before
    admitting it, the grammar worker routes it again."""
    chosen = ROUTES.get(grammar)
    if chosen is None:
        source = _xgrammar_source(grammar)
        if source is not None and _xgrammar_checks(source):
            chosen = Route("xgrammar", source)
        else:
            chosen = Route("llguidance", ("lark", grammar_text(grammar)))
        ROUTES.put(grammar, chosen)
    return chosen


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar for `grammar`, checked; raises `GrammarError` naming the problem."""
    llg = _llguidance()
    kind, spec = grammar.kind, grammar.spec
    try:
        if kind == "json_object":
            text = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
        elif kind == "json_schema":
            text = llg.LLMatcher.grammar_from_json_schema(json.loads(spec), JSON_OPTIONS)
        elif kind == "regex":
            text = llg.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            text = llg.LLMatcher.grammar_from_lark(f"start: {alternatives(json.loads(spec))}")
        else:
            text = llg.LLMatcher.grammar_from_lark(spec)
    except ValueError as e:
        raise GrammarError(f"the {kind} is not valid: {e}") from e
    error = llg.LLMatcher.validate_grammar(text)
    if error:
        raise GrammarError(f"the {kind} cannot be enforced by this server: {error}")
    return text

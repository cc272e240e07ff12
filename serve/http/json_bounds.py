"""Bounds on the shape of client-supplied JSON, checked without recursion before anything
recurses over it (Python's JSON parser, pydantic, the schema walkers and the grammar compilers
each recurse once per level: a body or a schema string nested 100,000 deep raised
RecursionError, a 500)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: linear, runs in C


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

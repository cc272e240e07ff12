"""Command-line flags derived from the config dataclasses, so each setting is written once.

A field becomes `--field-name` (or the spelling given), typed by its annotation: `bool` a
`--x / --no-x` pair, a `Literal` a choice, `Range` / `Size` metadata a checked number or byte
size; its help is the docstring under the field and its default the dataclass's. A flag not
given is absent from the parsed namespace, so `config_from_args` leaves the dataclass default.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from serve.core.config import Range, Size, field_hints, field_meta

C = TypeVar("C")


def attribute_docs(cls: type) -> dict[str, str]:
    """{field: the string literal under its annotation} of a class, whitespace folded."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def parse_size(text: str) -> int:
    """Bytes from '512MiB', '2GiB', '1e9' or a plain integer (> 0)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    units |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    lowered = text.strip().lower()
    number, factor = lowered, 1
    for unit, unit_factor in units.items():
        if lowered.endswith(unit):
            number, factor = lowered[: -len(unit)], unit_factor
            break
    try:
        value = int(float(number) * factor)
    except (ValueError, OverflowError):
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive size; use e.g. 512MiB, 2GiB or 1e9"
        )
    return value


def number_in(bound: Range, kind: type[int] | type[float] = int) -> Callable[[str], float]:
    """An argparse type: a number of `kind` inside `bound`."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not bound.contains(value):
            raise argparse.ArgumentTypeError(
                f"{value} is out of range; allowed: {bound.describe()}"
            )
        return value

    return parse


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""
    return number_in(Range(low, high), int)  # type: ignore[return-value]


def _base(hint: Any) -> Any:
    """The type under Annotated and Optional."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _parse_kwargs(cls: type, name: str) -> dict[str, Any]:
    base = _base(field_hints(cls)[name])
    meta = field_meta(cls, name)
    if base is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(base) is Literal:
        return {"choices": list(typing.get_args(base))}
    if any(isinstance(m, Size) for m in meta):
        return {"type": parse_size, "metavar": "BYTES"}
    bound = next((m for m in meta if isinstance(m, Range)), None)
    if bound is not None and base in (int, float):
        return {"type": number_in(bound, base), "metavar": "N" if base is int else "X"}
    return {"type": base if base in (int, float, Path) else str}


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    spelling: dict[str, str] | None = None,
    default_text: dict[str, str] | None = None,
    skip: tuple[str, ...] = (),
) -> None:
    """One flag per field of the dataclass `cls` (but `skip`)."""
    docs = attribute_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = (spelling or {}).get(f.name, "--" + f.name.replace("_", "-"))
        default = (default_text or {}).get(f.name)
        if default is None:
            default = "none" if f.default is None else str(f.default)
        text = f"{docs[f.name]} (default: {default})".replace("%", "%%")
        parser.add_argument(
            flag, dest=f.name, default=argparse.SUPPRESS, help=text, **_parse_kwargs(cls, f.name)
        )


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` given on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def config_from_args(cls: type[C], args: argparse.Namespace, **fixed: Any) -> C:
    """`cls` with the flags given and the dataclass defaults for the rest."""
    return cls(**(given(cls, args) | fixed))

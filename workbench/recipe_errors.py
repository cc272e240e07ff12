"""Turn pydantic's validation errors into lines a recipe author can act on.

Each line reads `FILE: FIELD.PATH: found X; allowed: Y`. The field path uses the recipe's own
spelling (`variants[2].steps[0].lora.rank`), and "allowed" comes from the schema itself (the keys
of the model at that path, the names of the registered steps, the literal values).
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails


class RecipeError(Exception):
    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        super().__init__("\n".join(f"{path}: {p}" for p in problems))


def _method_tags(model: type[BaseModel]) -> tuple[str, ...]:
    """The `method` values that select `model` in a step's tagged union of params."""
    field = model.model_fields.get("method")
    return typing.get_args(field.annotation) if field is not None else ()


def _tags() -> set[str]:
    from compress import STEPS

    return {t for cls in STEPS.values() for m in _models_in(cls.Params) for t in _method_tags(m)}


def _is_tag(loc: tuple[int | str, ...], i: int, tags: set[str]) -> bool:
    """pydantic names the member of a params union (`gptq`) after the repeated step key."""
    return i >= 2 and loc[i - 1] == loc[i - 2] and loc[i] in tags


def _field_path(loc: tuple[int | str, ...], tags: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    out = ""
    previous: int | str | None = None
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != previous and not _is_tag(loc, i, tags):  # a step's key repeats: once
            out += f".{part}" if out else part
        previous = part
    return out or "(top level)"


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Annotated,):
        args = args[:1]
    return [m for a in args for m in _models_in(a)]


def _model_at(root: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class whose instance sits at `loc`, following fields, lists and unions."""
    candidates: list[type[BaseModel]] = [root]
    tags = _tags()
    for i, part in enumerate(loc):
        if isinstance(part, int) or (i and loc[i - 1] == part):  # a step's tag repeats its key
            continue
        if _is_tag(loc, i, tags):  # the member of a params union that `method` selects
            candidates = [c for c in candidates if part in _method_tags(c)]
            continue
        nxt = [
            m
            for c in candidates
            if part in c.model_fields
            for m in _models_in(c.model_fields[part].annotation)
        ]
        tagged = [c for c in candidates if part in c.model_fields and not nxt]
        candidates = nxt or tagged
        if not candidates:
            return None
    return candidates[0] if len(candidates) == 1 else None


def _found(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(error: ErrorDetails, root: type[BaseModel]) -> str:
    kind, loc, value = error["type"], error["loc"], error.get("input")
    if kind == "extra_forbidden":
        parent = _model_at(root, loc[:-1])
        allowed = (", ".join(parent.model_fields) or "(none)") if parent else "see docs/recipes.md"
        return f"unknown key {loc[-1]!r}; allowed keys: {allowed}"
    if kind == "missing":
        return f"missing required key {loc[-1]!r}"
    if kind == "step_shape":
        from compress import STEPS

        names = ", ".join(STEPS)
        if isinstance(value, dict) and len(value) == 1:
            return f"unknown step {next(iter(value))!r}; allowed steps: {names}"
        return f"found {_found(value)}; a step is a mapping with exactly one key, one of: {names}"
    if kind == "union_tag_invalid":
        ctx = error.get("ctx", {})
        return f"found {ctx.get('tag')!r}; allowed: {ctx.get('expected_tags')}"
    if kind == "union_tag_not_found":
        return (
            f"missing required key {error.get('ctx', {}).get('discriminator', '').strip(chr(39))!r}"
        )
    message = error["msg"]
    if message.startswith("Value error, "):
        return message.removeprefix("Value error, ")
    allowed = message.removeprefix("Input should be ")
    return f"found {_found(value)}; allowed: {allowed}"


def _path(error: ErrorDetails, tags: set[str]) -> str:
    path = _field_path(error["loc"], tags)
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        return f"{path}.{error.get('ctx', {}).get('discriminator', '').strip(chr(39))}"
    return path


def format_validation_error(error: ValidationError, root: type[BaseModel]) -> list[str]:
    tags = _tags()
    return [f"{_path(e, tags)}: {_describe(e, root)}" for e in error.errors()]

"""The strict base of every request body (unknown fields refused, types strict, every string
valid Unicode) and the output constraints a request may carry: OpenAI's `response_format` and
vLLM's `structured_outputs`, each bounded before any grammar is compiled
(`serve.http.bounds`)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve.core.sampling_params import Grammar
from serve.http.bounds import (
    MAX_SCHEMA_DEPTH,
    check_grammar_size,
    check_grammar_text,
    check_schema,
    json_depth,
)

MAX_CHOICES = 256
"""Choices of a structured `choice` constraint."""


def _check_text(value: Any) -> None:
    """Raise ValueError for a string anywhere in `value` that UTF-8 cannot encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"a string holds {value[e.start : e.end]!r} at character {e.start}, "
                "which is not valid Unicode (a lone surrogate); send valid UTF-8 text"
            ) from None
    elif isinstance(value, list | tuple):
        for item in value:
            _check_text(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _check_text(item)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_text(value)
        return value


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = Field(default_factory=dict)
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_schema(value)


class ResponseFormat(Strict):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON under a schema."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('give json_schema exactly when type is "json_schema"')
        return self


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` extension: exactly one constraint."""

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect)."""
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    @field_validator("json_")
    @classmethod
    def _json_text(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        if value is None:
            return None
        if not isinstance(value, str):
            return check_schema(value)
        check_grammar_size(value, "the schema")
        if (depth := json_depth(value.encode("utf-8", "replace"))) > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"the schema text nests JSON {depth} deep; at most {MAX_SCHEMA_DEPTH}: flatten it"
            )
        try:
            schema = json.loads(value)
        except ValueError as e:
            raise ValueError(f"json is a string but not JSON ({e}); send the schema") from None
        if not isinstance(schema, dict):
            raise ValueError("json must be a JSON schema object")
        return check_schema(schema)

    @field_validator("regex", "grammar")
    @classmethod
    def _bounded_text(cls, value: str | None) -> str | None:
        return None if value is None else check_grammar_text(value, "the grammar")

    @field_validator("choice")
    @classmethod
    def _bounded_choices(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            check_grammar_size(json.dumps(value), "the choice list")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "give exactly one of json, regex, choice, grammar, json_object; got "
                f"{[g.rstrip('_') for g in given] or 'none'}"
            )
        return self

    def to_grammar(self) -> Grammar:
        if self.json_ is not None:
            return Grammar("json_schema", json.dumps(self.json_))
        if self.regex is not None:
            return Grammar("regex", self.regex)
        if self.choice is not None:
            return Grammar("choice", json.dumps(self.choice))
        if self.grammar is not None:
            return Grammar("lark", self.grammar)
        return Grammar("json_object")

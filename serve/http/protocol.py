"""OpenAI-compatible request and response bodies (pydantic), as the official client sends them.

Unknown fields are refused (`extra="forbid"`), so a typo never silently changes a request.
Types are strict, as OpenAI's API is: `true` is not a token id, `"yes"` is not a boolean, `"0.5"`
is not a number (an integer is a number). Every string must be valid Unicode (no lone surrogates:
JSON can carry `"\ud800"`, a tokenizer cannot). Fields OpenAI defines but this server does not
implement are accepted only at their neutral value.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from serve.core.sampling_params import SEED_MAX, SEED_MIN, Grammar, OutputKind, SamplingParams
from serve.http.bounds import (
    prompt_shape_problem,
)
from serve.http.constraints import ResponseFormat, Strict, StructuredOutputs

MAX_N = 16
MAX_PATH_CHARS = 4096
MAX_PROMPTS = 2048
"""Prompts in one completions request (OpenAI's limit for a list of inputs)."""
MAX_TOKEN_LIST = 1024
"""Entries of logit_bias and of stop_token_ids."""
MAX_TOKEN_ID_DIGITS = 10
"""Digits of a token id given as a string (logit_bias keys): more than any vocabulary."""
_TOKEN_ID = re.compile(rf"[0-9]{{1,{MAX_TOKEN_ID_DIGITS}}}")
"""A token id as a string: ASCII digits only (`str.isdigit` also takes '²' and '①', which
`int` refuses), and few enough of them that `int` never meets its 4,300-digit limit."""


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    model: str
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=1)] | None = None
    """An extension (as in vLLM): keep the k most likely tokens."""
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    """An extension (as in vLLM)."""
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0
    """An extension (as in vLLM)."""
    min_tokens: Annotated[int, Field(ge=0)] = 0
    """An extension (as in vLLM): no end-of-sequence, stop id or stop string before this many."""
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_TOKEN_LIST)] | None = None
    """Token id (as a string, as OpenAI sends it) -> bias in [-100, 100]."""
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_TOKEN_LIST)] | None = None
    """An extension (as in vLLM): end the request after any of these tokens."""
    include_stop_str_in_output: bool = False
    """An extension (as in vLLM)."""
    skip_special_tokens: bool = True
    """An extension (as in vLLM)."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    """An extension (as in vLLM): a JSON schema, regex, choice list or Lark grammar."""
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    """Choice i of n samples with seed + i (mod 2**64)."""
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """An extension (as in vLLM)."""
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(
                    f"logit_bias keys are token ids (at most {MAX_TOKEN_ID_DIGITS} ASCII digits), "
                    f"got {key[:40]!r}"
                )
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        if self.structured_outputs is not None and self.grammar_from_format() is not None:
            raise ValueError("give response_format or structured_outputs, not both")
        return self

    def grammar_from_format(self) -> Grammar | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.json_schema is None:
            return Grammar("json_object")
        return Grammar("json_schema", json.dumps(fmt.json_schema.schema_))

    def grammar(self) -> Grammar | None:
        """The output constraint the request asks for (None: free text)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.to_grammar()
        return self.grammar_from_format()

    def with_defaults(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The sampling fields the request set, the others from `defaults` (the model's
        generation config) where it has them."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        return {
            n: getattr(self, n) if n in self.model_fields_set else defaults.get(n, getattr(self, n))
            for n in names
        }

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        return stops

    def sampling_params(
        self,
        max_tokens: int,
        index: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        defaults: dict[str, Any] | None = None,
        grammar: Grammar | None = None,
    ) -> SamplingParams:
        """Choice `index` of `n`: a seeded request gets seed + index, so choices differ.
        `defaults`: the model's generation config, for fields the request leaves out."""
        return SamplingParams(
            max_tokens=max_tokens,
            **self.with_defaults(defaults or {}),
            seed=None if self.seed is None else (self.seed + index) % 2**64,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            grammar=grammar,
            output_kind=OutputKind.DELTA if self.stream else OutputKind.FINAL_ONLY,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @model_validator(mode="before")
    @classmethod
    def _prompt_count(cls, data: Any) -> Any:
        """Refuse too many prompts before any of them is validated (work bounded by the
        bound, not by the body)."""
        value = data.get("prompt") if isinstance(data, dict) else None
        if not isinstance(value, list) or not value or not isinstance(value[0], list | str):
            return data
        if len(value) > MAX_PROMPTS:
            raise ValueError(
                f"prompt: {len(value)} prompts in one request; at most {MAX_PROMPTS}: split "
                "them into several requests"
            )
        return data

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """The union is checked in pydantic's core (a list of a million ids costs no Python
        loop); only a refused prompt is walked, to say which item breaks its shape."""
        try:
            return handler(value)
        except ValidationError:
            if (problem := prompt_shape_problem(value)) is None:
                raise
            raise ValueError(problem) from None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if (
            value == ""
            or value == []
            or (isinstance(value, list) and any(p in ("", []) for p in value))
        ):
            raise ValueError("the prompt is empty; send at least one character or token id")
        return value

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]
    """Text, or a list of content parts of which only `{"type": "text", "text": ...}` is taken
    (joined with newlines, as vLLM does); other part types are refused."""
    name: str | None = None

    @field_validator("content", mode="after")
    @classmethod
    def _text_parts(cls, value: str | list[dict[str, Any]]) -> str:
        if isinstance(value, str):
            return value
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type")
            if kind != "text":
                raise ValueError(
                    f"content part {i} has type {kind!r}; this server takes text parts only: "
                    '{"type": "text", "text": "..."}'
                )
            if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                raise ValueError(
                    f'content part {i} must be {{"type": "text", "text": "<string>"}}, got '
                    f"keys {sorted(part)}"
                )
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _one_max(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


LoraName = Annotated[
    str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
]


class LoadLoraRequest(Strict):
    lora_name: LoraName
    lora_path: Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]
    evict: bool = False
    """An extension: when the server already holds --max-cpu-loras adapters, drop the least
    recently used one to make room (without it such a load is refused with 409)."""

    @field_validator("lora_path")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("lora_path contains a NUL character; send a plain path")
        return value


class UnloadLoraRequest(Strict):
    lora_name: Annotated[str, Field(min_length=1, max_length=128)]

"""OpenAI-compatible request and response bodies (pydantic), as the official client sends them.

Unknown fields are refused (`extra="forbid"`), so a typo never silently changes a request.
Types are strict, as OpenAI's API is: `true` is not a token id, `"yes"` is not a boolean, `"0.5"`
is not a number (an integer is a number). Every string must be valid Unicode (no lone surrogates:
JSON can carry `"\ud800"`, a tokenizer cannot). Fields OpenAI defines but this server does not
implement are accepted only at their neutral value.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve.core.sampling_params import SEED_MAX, SEED_MIN, SamplingParams

MAX_N = 16
MAX_PATH_CHARS = 4096


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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_text(value)
        return value


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    model: str
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=1)] | None = None
    """An extension (as in vLLM): keep the k most likely tokens."""
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    """Choice i of n samples with seed + i (mod 2**64)."""
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """An extension (as in vLLM)."""
    user: str | None = None
    presence_penalty: float = 0
    frequency_penalty: float = 0

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0:
            raise ValueError("penalties are not implemented by this server; leave them at 0")
        return value

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
    ) -> SamplingParams:
        """Choice `index` of `n`: a seeded request gets seed + index, so choices differ."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=None if self.seed is None else (self.seed + index) % 2**64,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    best_of: Literal[1] | None = None
    suffix: None = None

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


class ChatMessage(_Strict):
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


class ChatCompletionRequest(_SamplingFields):
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


class LoadLoraRequest(_Strict):
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


class UnloadLoraRequest(_Strict):
    lora_name: Annotated[str, Field(min_length=1, max_length=128)]

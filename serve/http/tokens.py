"""`POST /tokenize`, `POST /detokenize` and `GET /version` (vLLM's): the server's tokenizer
and chat template as clients check them, and what this server supports."""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import Field

from serve.core.sampling_params import GRAMMAR_KINDS
from serve.http.chat import render_chat
from serve.http.constraints import Strict
from serve.http.protocol import ChatMessage
from serve.http.serving import RequestError, encode, token_strings
from serve.http.state import Server

router = APIRouter()

MAX_DETOKENIZE = 1 << 20
"""Token ids in one /detokenize request."""


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (the template writes them)."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: Annotated[list[int], Field(max_length=MAX_DETOKENIZE)]


def tokenize(body: TokenizeRequest, server: Server) -> dict[str, Any]:
    """Blocking (tokenizes): call it off the event loop."""
    engine = server.engine
    if (body.prompt is None) == (body.messages is None):
        raise RequestError(400, "give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        text = render_chat(
            engine.tokenizer, body.messages, server.chat_template, body.add_generation_prompt
        )
        special = bool(body.add_special_tokens)
    else:
        assert body.prompt is not None
        text = body.prompt
        special = body.add_special_tokens is not False
    ids = encode(engine.tokenizer, text, engine.max_model_len, add_special_tokens=special)
    return {
        "count": len(ids),
        "max_model_len": engine.max_model_len,
        "tokens": ids,
        "token_strs": token_strings(engine.tokenizer, ids) if body.return_token_strs else None,
    }


@router.post("/tokenize")
async def create_tokenize(body: TokenizeRequest, server: Server) -> dict[str, Any]:
    if body.model is not None:
        server.check_model(body.model)
    return await asyncio.to_thread(tokenize, body, server)


@router.post("/detokenize")
async def create_detokenize(body: DetokenizeRequest, server: Server) -> dict[str, Any]:
    if body.model is not None:
        server.check_model(body.model)
    vocab = server.engine.vocab_size
    if bad := [t for t in body.tokens if not 0 <= t < vocab]:
        raise RequestError(
            400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens"
        )
    tok = server.engine.tokenizer
    text = await asyncio.to_thread(tok.decode, body.tokens)
    return {"prompt": text}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@router.get("/version")
async def version(server: Server) -> dict[str, Any]:
    return {
        "version": _version("workbench"),
        "features": {
            "structured_outputs": {
                "backend": f"xgrammar {_version('xgrammar')}",
                "fallback": f"llguidance {_version('llguidance')}",
                "fallback_for": "Lark grammars; JSON schemas with keywords xgrammar ignores",
                "kinds": list(GRAMMAR_KINDS),
                "request_fields": ["response_format", "structured_outputs"],
            },
            "sampling": [
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "logit_bias",
                "min_tokens",
                "stop",
                "stop_token_ids",
                "include_stop_str_in_output",
                "skip_special_tokens",
                "ignore_eos",
            ],
            "logprobs": {"max_top_logprobs": 20, "streamed": True, "prompt_logprobs": True},
            "generation_config_defaults": server.engine.sampling_defaults,
            "lora": server.engine.lora_enabled,
        },
    }

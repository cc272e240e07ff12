"""`POST /v1/chat/completions`: messages rendered with the model's chat template, choices with
optional logprobs out, whole or as a server-sent-event stream of deltas."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from transformers import PreTrainedTokenizerBase

from serve.engine.async_engine import AsyncEngine
from serve.engine.llm_engine import RequestOutput
from serve.engine.output_collector import Tracked
from serve.http.protocol import ChatCompletionRequest, ChatMessage, new_id
from serve.http.serving import (
    Job,
    RequestError,
    add_all,
    check_lengths,
    check_token_ids,
    checked_grammar,
    collect,
    encode,
    envelope,
    event_stream,
    grammar_field,
    merged,
    sse,
    token_strings,
    usage,
)
from serve.http.state import Server

router = APIRouter()


def render_chat(
    tok: PreTrainedTokenizerBase,
    messages: list[ChatMessage],
    chat_template: str | None,
    add_generation_prompt: bool = True,
) -> str:
    """The conversation as the chat template writes it (None: the tokenizer's template)."""
    turns = [m.model_dump(exclude_none=True) for m in messages]
    try:
        text = tok.apply_chat_template(
            turns,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            chat_template=chat_template,
        )
        assert isinstance(text, str)  # tokenize=False: the rendered conversation
    except Exception as e:  # a template that rejects the conversation (e.g. role order)
        raise RequestError(400, f"the chat template rejected the messages: {e}", "messages") from e
    return text


def chat_job(
    body: ChatCompletionRequest,
    tok: PreTrainedTokenizerBase,
    max_model_len: int,
    context_limit: int,
    defaults: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> Job:
    """Blocking (tokenizes): call it off the event loop. Without max_tokens, a choice may run to
    `context_limit` (max_model_len, or the KV cache's size when that is smaller), or to the
    generation config's max_new_tokens when that is less. `chat_template`: the server's
    --chat-template (None: the tokenizer's)."""
    defaults = defaults or {}
    grammar = checked_grammar(body)
    text = render_chat(tok, body.messages, chat_template)
    prompt = encode(tok, text, max_model_len, add_special_tokens=False)  # bos: the template's
    requested = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    room = context_limit - len(prompt)
    max_tokens = min(room, defaults.get("max_tokens", room)) if requested is None else requested
    if max_tokens < 1 and requested is None:
        raise RequestError(
            400,
            f"the conversation is {len(prompt)} tokens, which leaves no room for an answer in "
            f"this server's context of {context_limit} tokens: shorten the messages",
            param="messages",
            code="context_length_exceeded",
        )
    check_lengths([prompt], max_tokens, max_model_len, body.min_tokens)
    top = body.top_logprobs or 0 if body.logprobs else None
    params = [
        body.sampling_params(max_tokens, i, top, None, defaults, grammar) for i in range(body.n)
    ]
    return Job([prompt], params, body.n, grammar_field=grammar_field(body))


def chat_logprobs(tok: PreTrainedTokenizerBase, out: RequestOutput, top_n: int) -> dict[str, Any]:
    content = []
    for token_id, lps in zip(out.token_ids, out.logprobs):
        (text,) = token_strings(tok, [token_id])
        ranked = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
        tops = [
            {"token": s, "logprob": lp, "bytes": list(s.encode())}
            for s, (_, lp) in zip(token_strings(tok, [i for i, _ in ranked]), ranked)
        ]
        content.append(
            {
                "token": text,
                "logprob": lps[token_id],
                "bytes": list(text.encode()),
                "top_logprobs": tops,
            }
        )
    return {"content": content}


def chat_choice(
    tok: PreTrainedTokenizerBase, index: int, out: RequestOutput, top_n: int | None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": out.text},
        "logprobs": chat_logprobs(tok, out, top_n) if top_n is not None else None,
        "finish_reason": out.finish_reason,
    }


async def chat_events(
    engine: AsyncEngine,
    rid: str,
    body: ChatCompletionRequest,
    job: Job,
    tracked: list[Tracked],
) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    head = envelope(rid, "chat.completion.chunk", body.model)
    for i in range(job.n):
        first = {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
        }
        yield sse({**head, "choices": [first]})
    async for index, out in merged(engine, tracked):
        if out.text or (top_n is not None and out.token_ids):
            choice = {"index": index, "delta": {"content": out.text}, "finish_reason": None}
            if top_n is not None:
                choice["logprobs"] = chat_logprobs(engine.tokenizer, out, top_n)
            yield sse({**head, "choices": [choice]})
        if out.finished:
            finals[index] = out
            yield sse(
                {
                    **head,
                    "choices": [{"index": index, "delta": {}, "finish_reason": out.finish_reason}],
                }
            )
    if body.stream_options and body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": usage(list(finals.values()), job.prompts)})
    yield sse("[DONE]")


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, server: Server
) -> Any:
    engine, tok = server.engine, server.engine.tokenizer
    server.check_room(body.model, body.n)
    check_token_ids(body, engine.vocab_size)
    job = await asyncio.to_thread(
        chat_job,
        body,
        tok,
        engine.max_model_len,
        engine.context_limit,
        engine.sampling_defaults,
        server.chat_template,
    )
    job = dataclasses.replace(job, adapter=server.admit(body.model, len(job.params)))
    rid = new_id("chatcmpl")
    tracked = await add_all(engine, rid, job)
    top_n = (body.top_logprobs or 0) if body.logprobs else None
    if body.stream:
        return event_stream(chat_events(engine, rid, body, job, tracked))
    outputs = await collect(engine, tracked, request.is_disconnected)
    return {
        **envelope(rid, "chat.completion", body.model),
        "choices": [chat_choice(tok, i, o, top_n) for i, o in enumerate(outputs)],
        "usage": usage(outputs, job.prompts),
    }

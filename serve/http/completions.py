"""`POST /v1/completions`: prompts (text or token ids) in, choices with optional logprobs out,
whole or as a server-sent-event stream (OpenAI's legacy completions API, as lm-eval uses it)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from transformers import PreTrainedTokenizerBase

from serve.core.detokenizer import decode_text
from serve.engine.async_engine import AsyncEngine
from serve.engine.llm_engine import RequestOutput
from serve.engine.output_collector import Tracked
from serve.http.protocol import CompletionRequest, new_id
from serve.http.serving import (
    Job,
    RequestError,
    add_all,
    check_lengths,
    check_prompt_ids,
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


def completion_job(
    body: CompletionRequest,
    tok: PreTrainedTokenizerBase,
    max_model_len: int,
    defaults: dict[str, Any] | None = None,
    vocab_size: int | None = None,
) -> Job:
    """Blocking (tokenizes): call it off the event loop. `defaults`: the model's generation
    config, for the sampling fields the request leaves out (max_tokens: its max_new_tokens, else
    16, OpenAI's default). `vocab_size`: token-id prompts are checked against it first."""
    defaults = defaults or {}
    if vocab_size is not None:
        check_prompt_ids(body.prompts(), vocab_size)
    grammar = checked_grammar(body)
    prompts = [
        encode(tok, p, max_model_len) if isinstance(p, str) else list(p) for p in body.prompts()
    ]
    if any(not p for p in prompts):
        raise RequestError(400, "a prompt tokenizes to no tokens; send text or token ids", "prompt")
    max_tokens = defaults.get("max_tokens", 16) if body.max_tokens is None else body.max_tokens
    check_lengths(prompts, max_tokens, max_model_len, body.min_tokens)
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    params = [
        body.sampling_params(max_tokens, i, body.logprobs, prompt_logprobs, defaults, grammar)
        for _ in prompts
        for i in range(body.n)
    ]
    return Job(prompts, params, body.n, body.echo, grammar_field=grammar_field(body))


def completion_logprobs(
    tok: PreTrainedTokenizerBase, out: RequestOutput, echo: bool, offset: int
) -> dict[str, Any]:
    """The legacy completions `logprobs` object (of a whole output or of a stream's delta,
    whose text starts at character `offset`); with echo, prompt tokens come first (the first
    prompt token has no logprob: None), as lm-eval's loglikelihood requests expect."""
    ids = (out.prompt_token_ids if echo else []) + out.token_ids
    per_token = (out.prompt_logprobs if echo else []) + list(out.logprobs)
    strings = token_strings(tok, ids)
    offsets, pos = [], offset
    for s in strings:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": strings,
        "token_logprobs": [None if lp is None else lp[i] for i, lp in zip(ids, per_token)],
        "top_logprobs": [None if lp is None else _top_all(tok, lp) for lp in per_token],
        "text_offset": offsets,
    }


def _top_all(tok: PreTrainedTokenizerBase, logprobs: dict[int, float]) -> dict[str, float]:
    ranked = sorted(logprobs.items(), key=lambda kv: -kv[1])
    return dict(zip(token_strings(tok, [i for i, _ in ranked]), [lp for _, lp in ranked]))


def completion_choice(
    tok: PreTrainedTokenizerBase, index: int, out: RequestOutput, echo: bool, want_logprobs: bool
) -> dict[str, Any]:
    prompt_text = decode_text(tok, out.prompt_token_ids) if echo else ""
    logprobs = completion_logprobs(tok, out, echo, 0) if want_logprobs else None
    return {
        "index": index,
        "text": prompt_text + out.text,
        "logprobs": logprobs,
        "finish_reason": out.finish_reason,
    }


async def completion_events(
    engine: AsyncEngine,
    tok: PreTrainedTokenizerBase,
    rid: str,
    body: CompletionRequest,
    job: Job,
    tracked: list[Tracked],
) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    offsets: dict[int, int] = {}
    """Per choice, the characters of the token strings sent so far (logprobs' text_offset,
    which counts token strings, as the whole answer's does)."""
    want_logprobs = body.logprobs is not None
    head = envelope(rid, "text_completion", body.model)
    async for index, out in merged(engine, tracked):
        echo = job.echo and index not in offsets
        text = (decode_text(tok, out.prompt_token_ids) if echo else "") + out.text
        logprobs = None
        if want_logprobs:
            logprobs = completion_logprobs(tok, out, echo, offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
        offsets.setdefault(index, 0)
        if text or out.finished or (logprobs and logprobs["tokens"]):
            choice = {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason,
            }
            yield sse({**head, "choices": [choice]})
        if out.finished:
            finals[index] = out
    if body.stream_options and body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": usage(list(finals.values()), job.prompts)})
    yield sse("[DONE]")


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, server: Server) -> Any:
    engine, tok = server.engine, server.engine.tokenizer
    server.check_room(body.model, len(body.prompts()) * body.n)
    check_token_ids(body, engine.vocab_size)
    defaults, vocab = engine.sampling_defaults, engine.vocab_size
    job = await asyncio.to_thread(completion_job, body, tok, engine.max_model_len, defaults, vocab)
    job = dataclasses.replace(job, adapter=server.admit(body.model, len(job.params)))
    rid = new_id("cmpl")
    tracked = await add_all(engine, rid, job)
    if body.stream:
        return event_stream(completion_events(engine, tok, rid, body, job, tracked))
    outputs = await collect(engine, tracked, request.is_disconnected)
    choices = [
        completion_choice(tok, i, o, job.echo, body.logprobs is not None)
        for i, o in enumerate(outputs)
    ]
    return {
        **envelope(rid, "text_completion", body.model),
        "choices": choices,
        "usage": usage(outputs, job.prompts),
    }

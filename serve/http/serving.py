"""What completions and chat completions share: a request as engine requests, and back.

Model: one HTTP request becomes `len(prompts) * n` engine requests (choice i of prompt p is
request `{id}-{p}-{i}`). They are all added before anything is returned, so a refused one turns
into a 400 and the others are aborted. Non-streaming answers wait for all of them (and abort all
if the client disconnects) and get one final output per choice; streaming answers merge the
choices' deltas into one server-sent-event stream, reading a choice's next delta only when the
previous one has been sent (so a client that stops reading stops the reading, and the engine's
bound on unread tokens applies).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse
from transformers import PreTrainedTokenizerBase

from serve.core.sampling_params import Grammar, SamplingParams
from serve.engine.async_engine import AsyncEngine
from serve.engine.llm_engine import RequestOutput
from serve.engine.output_collector import EngineDeadError, RequestFailed, Tracked
from serve.http.protocol import SamplingFields, error_body, now
from serve.model.grammar_engines import GrammarError, route


class ClientGone(Exception):
    """The client disconnected before its (non-streaming) answer was ready; its requests are
    aborted and nobody is left to read a response."""


class RequestError(Exception):
    """A client error detected after parsing: answered with `status` and an OpenAI error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(frozen=True)
class Job:
    """What one HTTP request asks the engine for."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    """One per choice (prompt-major)."""
    n: int
    echo: bool = False
    adapter: str | None = None
    """The LoRA adapter every choice runs on (None: the base model)."""
    grammar_field: str = "structured_outputs"
    """The field that gave the output constraint (named when it fails to compile)."""


def check_lengths(
    prompts: list[list[int]], max_tokens: int, max_model_len: int, min_tokens: int = 0
) -> None:
    if min_tokens > max_tokens:
        raise RequestError(
            400,
            f"min_tokens ({min_tokens}) is more than max_tokens ({max_tokens}); lower min_tokens "
            "or raise max_tokens",
            param="min_tokens",
        )
    for p in prompts:
        if len(p) + max_tokens > max_model_len:
            raise RequestError(
                400,
                f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{len(p)} and max_tokens is {max_tokens} ({len(p) + max_tokens} in all): shorten "
                "the prompt or lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )


def check_token_ids(body: SamplingFields, vocab_size: int) -> None:
    """400 naming the field for a logit_bias key or stop token id outside the vocabulary."""
    for field, ids in (
        ("logit_bias", [int(k) for k in body.logit_bias or {}]),
        ("stop_token_ids", body.stop_token_ids or []),
    ):
        if bad := [t for t in ids if not 0 <= t < vocab_size]:
            raise RequestError(
                400,
                f"{field} names token ids {bad[:5]} outside the vocabulary [0, {vocab_size})",
                param=field,
            )


def check_prompt_ids(prompts: list[str | list[int]], vocab_size: int) -> None:
    """400 naming `prompt` for a token-id prompt holding an id outside the vocabulary."""
    for p in prompts:
        if isinstance(p, list) and (bad := [t for t in p if not 0 <= t < vocab_size]):
            raise RequestError(
                400,
                f"prompt holds token ids {bad[:5]} outside the vocabulary [0, {vocab_size})",
                param="prompt",
            )


CHARS_PER_TOKEN_BOUND = 16
"""A prompt longer than max_model_len x this many characters is first tokenized in part."""


def encode(
    tok: PreTrainedTokenizerBase, text: str, max_model_len: int, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of `text`, with work bounded by `max_model_len`: a text whose first
    `max_model_len * CHARS_PER_TOKEN_BOUND` characters already make more than `max_model_len`
    tokens (plus a margin for merges across the cut) is refused without tokenizing the rest."""
    cut = max_model_len * CHARS_PER_TOKEN_BOUND
    if len(text) > cut:
        head = tok(text[:cut], add_special_tokens=add_special_tokens).input_ids
        if len(head) > max_model_len + 64:
            raise RequestError(
                400,
                f"this model's maximum context length is {max_model_len} tokens; the prompt's "
                f"first {cut} of {len(text)} characters are already {len(head)} tokens: "
                "shorten the prompt",
                param="prompt",
                code="context_length_exceeded",
            )
    return tok(text, add_special_tokens=add_special_tokens).input_ids


async def add_all(engine: AsyncEngine, base_id: str, job: Job) -> list[Tracked]:
    """Add every choice; if one is refused, abort those already added and re-raise."""
    added: list[Tracked] = []
    try:
        for p, prompt in enumerate(job.prompts):
            for i in range(job.n):
                params = job.params[p * job.n + i]
                added.append(await engine.add(f"{base_id}-{p}-{i}", prompt, params, job.adapter))
    except GrammarError as e:
        await engine.abort_all([t.request_id for t in added])
        raise RequestError(400, str(e), job.grammar_field) from e
    except BaseException:
        await engine.abort_all([t.request_id for t in added])
        raise
    return added


async def collect(
    engine: AsyncEngine, tracked: list[Tracked], disconnected: Callable
) -> list[RequestOutput]:
    """Final outputs of all choices; aborts all of them if the client goes away first."""

    async def final(t: Tracked) -> RequestOutput:
        last = None
        async for last in engine.stream(t):  # noqa: B007
            pass
        assert last is not None
        return last

    tasks = [asyncio.ensure_future(final(t)) for t in tracked]
    gathered = asyncio.ensure_future(asyncio.gather(*tasks))
    while not gathered.done():
        await asyncio.wait({gathered}, timeout=0.25)
        if not gathered.done() and await disconnected():
            gathered.cancel()
            gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
            await engine.abort_all([t.request_id for t in tracked])
            raise ClientGone()
    return gathered.result()


async def merged(
    engine: AsyncEngine, tracked: list[Tracked]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all choices as they come; aborts the rest if closed early."""
    reads = {asyncio.ensure_future(t.collector.get()): i for i, t in enumerate(tracked)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in done:
                index = reads.pop(read)
                out = read.result()
                yield index, out
                if not out.finished:
                    reads[asyncio.ensure_future(tracked[index].collector.get())] = index
    finally:
        for read in reads:
            read.cancel()
        # every choice at once: a stream whose client left runs this in a cancelled scope,
        # where each await is cancelled again (one abort per await left n - 1 running)
        await engine.abort_all([t.request_id for t in tracked if not t.finished])


def checked_grammar(body: SamplingFields) -> Grammar | None:
    """The request's output constraint, checked (blocking the first time a grammar is seen:
    call it off the event loop); a constraint the server cannot honour is a 400 naming it."""
    grammar = body.grammar()
    if grammar is not None:
        try:
            route(grammar)
        except GrammarError as e:
            raise RequestError(400, str(e), grammar_field(body)) from e
    return grammar


def grammar_field(body: SamplingFields) -> str:
    return "structured_outputs" if body.structured_outputs else "response_format"


def usage(outputs: list[RequestOutput], prompts: list[list[int]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(o.num_output_tokens for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def envelope(request_id: str, kind: str, model: str) -> dict[str, Any]:
    """The fields every OpenAI response body and stream chunk starts with."""
    return {"id": request_id, "object": kind, "created": now(), "model": model}


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def token_strings(tok: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    return tok.batch_decode([[i] for i in ids])


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, and an error event then [DONE] if the engine fails the request mid-stream."""
    try:
        async for event in events:
            yield event
    except (RequestFailed, EngineDeadError) as e:
        yield sse(error_body(str(e), "server_error"))
        yield sse("[DONE]")


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        _guarded(events),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )

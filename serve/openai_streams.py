"""Server-sent-event streams of completion and chat chunks, as OpenAI's streaming API sends them."""

from __future__ import annotations

from collections.abc import AsyncIterator

from transformers import PreTrainedTokenizerBase

from serve.async_engine import AsyncEngine, Tracked
from serve.detokenizer import decode_text
from serve.openai_serving import Job, TextDeltas, merged, now, sse, usage
from serve.protocol import ChatCompletionRequest, CompletionRequest


async def completion_events(
    engine: AsyncEngine,
    tok: PreTrainedTokenizerBase,
    rid: str,
    body: CompletionRequest,
    job: Job,
    tracked: list[Tracked],
) -> AsyncIterator[str]:
    deltas, finals = TextDeltas(job.params[0].stop), {}
    head = {"id": rid, "object": "text_completion", "created": now(), "model": body.model}
    async for index, out in merged(engine, tracked):
        text = deltas.delta(index, out)
        if job.echo and index not in deltas.sent_prompt:
            deltas.sent_prompt.add(index)
            text = decode_text(tok, out.prompt_token_ids) + text
        if text or out.finished:
            choice = {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": out.finish_reason,
            }
            yield sse({**head, "choices": [choice]})
        if out.finished:
            finals[index] = out
    if body.stream_options and body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": usage(list(finals.values()), job.prompts)})
    yield sse("[DONE]")


async def chat_events(
    engine: AsyncEngine,
    rid: str,
    body: ChatCompletionRequest,
    job: Job,
    tracked: list[Tracked],
) -> AsyncIterator[str]:
    deltas, finals = TextDeltas(job.params[0].stop), {}
    head = {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": body.model}
    for i in range(job.n):
        first = {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
        }
        yield sse({**head, "choices": [first]})
    async for index, out in merged(engine, tracked):
        text = deltas.delta(index, out)
        if text:
            yield sse(
                {
                    **head,
                    "choices": [
                        {"index": index, "delta": {"content": text}, "finish_reason": None}
                    ],
                }
            )
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

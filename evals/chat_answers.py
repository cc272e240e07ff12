"""Each variant's greedy answers to a few fixed chat prompts, through its server: people judge a
variant by reading it.

Model: one `/v1/chat/completions` request per prompt (temperature 0, `max_tokens` cap) to the
server that serves the variant (an adapter by its name on its base's server), so the answers are
what a user of that server gets: the chat template applied by the engine, greedy decoding. The
prompts are sent together, so the engine decodes them in one batch (a step per answer token, not
per prompt and token); an answer can differ from the one asked alone only where two tokens' float
logits tie within the batch's rounding.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


async def _answer(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"chat {prompt!r} on {model}: HTTP {r.status_code}: {r.text[:300]}")
    data = r.json()
    choice = data["choices"][0]
    return {
        "prompt": prompt,
        "answer": choice["message"]["content"],
        "finish_reason": choice["finish_reason"],
        "completion_tokens": data["usage"]["completion_tokens"],
    }


async def _answers(
    url: str, model: str, prompts: list[str], max_tokens: int
) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return list(
            await asyncio.gather(*(_answer(client, url, model, p, max_tokens) for p in prompts))
        )


def chat_answers(url: str, model: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """[{prompt, answer, finish_reason, completion_tokens}] in prompt order."""
    return asyncio.run(_answers(url, model, prompts, max_tokens))

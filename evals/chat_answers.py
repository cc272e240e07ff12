"""Each variant's greedy answers to a few fixed chat prompts, through its server: people judge a
variant by reading it.

Model: one `/v1/chat/completions` request per prompt (temperature 0, `max_tokens` cap) to the
server that serves the variant (an adapter by its name on its base's server), so the answers are
what a user of that server gets: the chat template applied by the engine, greedy decoding. The
prompts are asked one at a time, each answer what one user of an idle server gets: sent
together they were twice as fast, but a batched prefill takes other products (int4 calls of 64
rows or more are dequantized) and rounds differently, so an answer at a near tie depended on how
the requests happened to arrive (int4-wo's "What is the capital of France?": "The" and "L" 0.1
apart in its logits, "The capital of France is Paris." alone, "L'Étoile, la Marseillaise, ..."
batched).
"""

from __future__ import annotations

from typing import Any

import httpx


def _answer(
    client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    r = client.post(f"{url}/v1/chat/completions", json=body)
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


def chat_answers(url: str, model: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """[{prompt, answer, finish_reason, completion_tokens}] in prompt order."""
    with httpx.Client(timeout=600) as client:
        return [_answer(client, url, model, p, max_tokens) for p in prompts]

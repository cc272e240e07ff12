"""Each variant's greedy answers to a few fixed chat prompts, through its server: people judge a
variant by reading it.

Model: one `/v1/chat/completions` request per prompt (temperature 0, `max_tokens` cap) to the
server that serves the variant (an adapter by its name on its base's server), so the answers are
what a user of that server gets: the chat template applied by the engine, greedy decoding.
"""

from __future__ import annotations

from typing import Any


def chat_answers(url: str, model: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """[{prompt, answer, finish_reason, completion_tokens}] in prompt order."""
    import httpx

    out = []
    for prompt in prompts:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"chat {prompt!r} on {model}: HTTP {r.status_code}: {r.text[:300]}")
        data = r.json()
        choice = data["choices"][0]
        out.append(
            {
                "prompt": prompt,
                "answer": choice["message"]["content"],
                "finish_reason": choice["finish_reason"],
                "completion_tokens": data["usage"]["completion_tokens"],
            }
        )
    return out

"""Chat answers: every prompt is in flight at once (the engine decodes them as one batch), the
answers come back in prompt order whatever order the server finishes them in, and a prompt the
server refuses is named in the error."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from evals.chat_answers import chat_answers
from tests.evals.fake_server import serving

PROMPTS = ["first", "second", "third"]


def together_app(expected: int) -> FastAPI:
    """Answers a prompt upper-cased once `expected` requests are in flight together (503 if they
    never are), the last to arrive first; refuses the prompt "refuse"."""
    app = FastAPI()
    arrived: list[str] = []
    all_in = asyncio.Event()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        prompt = body["messages"][0]["content"]
        arrived.append(prompt)
        if len(arrived) == expected:
            all_in.set()
        try:
            await asyncio.wait_for(all_in.wait(), timeout=5)
        except TimeoutError:
            return JSONResponse({"error": f"{prompt} arrived alone"}, status_code=503)
        if prompt == "refuse":
            return JSONResponse({"error": {"message": "no"}}, status_code=400)
        await asyncio.sleep(0.05 * (expected - arrived.index(prompt)))
        choice = {"message": {"content": prompt.upper()}, "finish_reason": "length"}
        return JSONResponse(
            {"choices": [choice], "usage": {"completion_tokens": body["max_tokens"]}}
        )

    return app


def test_chat_prompts_are_sent_together_and_answered_in_prompt_order() -> None:
    with serving(together_app(len(PROMPTS))) as url:
        answers = chat_answers(url, "m", PROMPTS, 7)
    assert [a["prompt"] for a in answers] == PROMPTS
    assert [a["answer"] for a in answers] == ["FIRST", "SECOND", "THIRD"]
    assert all(a["completion_tokens"] == 7 and a["finish_reason"] == "length" for a in answers)


def test_a_refused_chat_prompt_is_named() -> None:
    with (
        serving(together_app(2)) as url,
        pytest.raises(RuntimeError, match="'refuse' on m: HTTP 400"),
    ):
        chat_answers(url, "m", ["fine", "refuse"], 4)

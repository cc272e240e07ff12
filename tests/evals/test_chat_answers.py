"""Chat answers: asked one prompt at a time (each what one user of an idle server gets: a batched
prefill rounds differently, and int4-wo's first answer token flipped at a near tie when the
three prompts were sent together), answered in prompt order, and a prompt the server refuses is
named in the error."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from evals.chat_answers import chat_answers
from tests.evals.fake_server import serving

PROMPTS = ["first", "second", "third"]


def recording_app(seen: list[tuple[str, int]]) -> FastAPI:
    """Answers a prompt upper-cased after a short wait, recording (prompt, requests in flight
    when it arrived); refuses the prompt "refuse"."""
    app = FastAPI()
    in_flight = 0

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        nonlocal in_flight
        body = await request.json()
        prompt = body["messages"][0]["content"]
        in_flight += 1
        seen.append((prompt, in_flight))
        try:
            await asyncio.sleep(0.05)
        finally:
            in_flight -= 1
        if prompt == "refuse":
            return JSONResponse({"error": {"message": "no"}}, status_code=400)
        choice = {"message": {"content": prompt.upper()}, "finish_reason": "length"}
        return JSONResponse(
            {"choices": [choice], "usage": {"completion_tokens": body["max_tokens"]}}
        )

    return app


def test_chat_prompts_are_asked_one_at_a_time_in_prompt_order() -> None:
    seen: list[tuple[str, int]] = []
    with serving(recording_app(seen)) as url:
        answers = chat_answers(url, "m", PROMPTS, 7)
    assert seen == [(p, 1) for p in PROMPTS]
    assert [a["prompt"] for a in answers] == PROMPTS
    assert [a["answer"] for a in answers] == ["FIRST", "SECOND", "THIRD"]
    assert all(a["completion_tokens"] == 7 and a["finish_reason"] == "length" for a in answers)


def test_a_refused_chat_prompt_is_named() -> None:
    with (
        serving(recording_app([])) as url,
        pytest.raises(RuntimeError, match="'refuse' on m: HTTP 400"),
    ):
        chat_answers(url, "m", ["fine", "refuse"], 4)

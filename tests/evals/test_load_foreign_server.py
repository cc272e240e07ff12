"""`workbench bench --url` against an OpenAI-compatible server that is not this one (as vLLM):
no workbench metrics, other metric names or none at all; the points are measured, and what the
server does not say is None instead of a crash."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from evals.load import sweep
from evals.settings import LoadEval
from tests.evals.fake_server import serving


def foreign_app(metrics: str | None) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "other", "object": "model"}]}

    @app.get("/metrics")
    def prometheus() -> PlainTextResponse:
        if metrics is None:
            return PlainTextResponse("Not Found", status_code=404)
        return PlainTextResponse(metrics)

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        n = (await request.json())["max_tokens"]

        async def events():  # type: ignore[no-untyped-def]
            for i in range(n):
                await asyncio.sleep(0.001)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
            usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(params=["vllm-metrics", "no-metrics"])
def foreign_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, float]]:
    """(url, the KV usage its metrics report: 0.25 by vLLM's gauge name, 0 without metrics)"""
    metrics = (
        "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.25\n"
        if request.param == "vllm-metrics"
        else None
    )
    with serving(foreign_app(metrics)) as url:
        yield url, 0.25 if metrics else 0.0


def test_bench_url_against_a_server_without_workbench_metrics(
    foreign_server: tuple[str, float],
) -> None:
    url, kv_usage = foreign_server
    load = LoadEval(concurrency=[1, 3], prompt_len=[8], max_tokens=5, requests_per_point=6)
    result = sweep(url, load)
    assert result.server.model == "other"
    assert result.server.kv_blocks is None and result.kv_tokens is None
    assert [p.concurrency for p in result.points] == [1, 3]
    for point in result.points:
        assert point.requests == 6 and point.failed == 0
        assert point.output_throughput > 0 and point.ttft.p50 > 0
        assert point.kv_full_queued_steps == 0 and not point.saturated
    assert result.saturation["8"].to_json() == {
        "measured_concurrency": None,
        "estimated_concurrency": None,
    }
    assert all(point.peak_kv_usage == kv_usage for point in result.points)

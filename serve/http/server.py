"""The OpenAI-compatible HTTP server: FastAPI routes over one `AsyncEngine`.

Contract: a client error is always a 4xx with an OpenAI error object naming the field and the
limit, and the server keeps serving; 503 with Retry-After when the waiting queue is full; with an
API key, every route but /health needs `Authorization: Bearer KEY`. A request whose engine step
failed gets a 500 (or an error event in its stream) and the others carry on; /health answers 503
while the engine is not serving. Prompts are tokenized off the event loop, with the server's own
tokenizer (the engine thread detokenizes with its own).

Layout: `completions`, `chat` and `adapters` hold the routes, `errors` the error handlers,
`state` what routes share; `build_app` only wires them.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from serve.engine.async_engine import AsyncEngine
from serve.http import adapters, chat, completions, tokens
from serve.http.errors import add_error_handlers
from serve.http.middleware import ApiKey, BodyLimit, CrossSiteGuard
from serve.http.protocol import now
from serve.http.state import Server, ServerSettings, ServerState, read_chat_template

router = APIRouter()


@router.get("/health")
async def health(server: Server) -> JSONResponse:
    engine = server.engine
    if engine.dead is not None:
        return JSONResponse({"status": f"engine failed: {engine.dead!r}"}, 503)
    if not engine.healthy:
        status = f"the last {engine.failed_steps_in_a_row} engine steps failed"
        return JSONResponse({"status": status}, 503)
    return JSONResponse({"status": "ok"})


def _model_card(name: str, parent: str | None, max_model_len: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": now(),
        "owned_by": "workbench",
        "root": name,
        "parent": parent,
        "max_model_len": max_model_len,
    }


@router.get("/v1/models")
async def models(server: Server) -> dict[str, Any]:
    base, max_len = server.settings.model_name, server.engine.max_model_len
    cards = [_model_card(base, None, max_len)]
    cards += [_model_card(name, base, max_len) for name in server.engine.adapter_names()]
    return {"object": "list", "data": cards}


@router.get("/metrics")
async def metrics(server: Server) -> Response:
    return Response(server.engine.metrics.render(), media_type="text/plain; version=0.0.4")


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        # what startup made (the model, the tokenizer, the engine) leaves the collector's scans,
        # as in vLLM: parsing a body of 300,000 small JSON lists took 1.3 s of collections over
        # the whole heap, on the event loop, and 0.17 s after this
        gc.collect()
        gc.freeze()
        yield
        engine.stop()

    app = FastAPI(title="workbench server", lifespan=lifespan)
    app.state.server = ServerState(engine, settings, read_chat_template(settings.chat_template))
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(ApiKey, key=settings.api_key)  # no body is read without the key
    app.add_middleware(  # outermost: a foreign page learns nothing, not even whether a key is set
        CrossSiteGuard,
        allowed_origins=settings.allowed_origins,
        allowed_hosts=settings.allowed_hosts,
        bind_host=settings.bind_host,
    )
    add_error_handlers(app)
    for routes in (router, completions.router, chat.router, adapters.router, tokens.router):
        app.include_router(routes)
    return app


__all__ = ["ServerSettings", "build_app"]

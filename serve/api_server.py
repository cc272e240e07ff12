"""The OpenAI-compatible HTTP server: FastAPI routes over one `AsyncEngine`.

Contract: a client error is always a 4xx with an OpenAI error object naming the field and the
limit, and the server keeps serving; 503 with Retry-After when the waiting queue is full; with an
API key, every route but /health needs `Authorization: Bearer KEY`. A request whose engine step
failed gets a 500 (or an error event in its stream) and the others carry on; /health answers 503
while the engine is not serving. Prompts are tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.async_engine import AsyncEngine, EngineDeadError, RequestFailed, UnknownAdapter
from serve.engine import InvalidRequest
from serve.http_middleware import ApiKey, BodyLimit, error_response
from serve.lora.adapter import AdapterError
from serve.lora.manager import AdapterLimit
from serve.openai_responses import chat_choice, completion_choice
from serve.openai_serving import (
    ClientGone,
    RequestError,
    add_all,
    chat_id,
    chat_job,
    collect,
    completion_id,
    completion_job,
    now,
    sse,
    usage,
)
from serve.openai_streams import chat_events, completion_events
from serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    UnloadLoraRequest,
    error_body,
)


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    """The name clients put in `model`."""
    api_key: str | None = None
    """When set, every route but /health needs `Authorization: Bearer <key>`."""
    max_waiting: int = 256
    """Most requests queued (not yet running); beyond it, 503 with Retry-After."""
    max_body_bytes: int = 4 << 20
    """Larger request bodies get 413."""
    lora_root: Path | None = None
    """When set, adapters load only from inside this directory (every file's symlinks resolved)."""
    allow_any_lora_path: bool = False
    """Without `lora_root`, loading adapters over HTTP is refused unless this is set: any path
    the server process can read could then be loaded."""


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


def _validation_message(exc: RequestValidationError) -> tuple[str, str]:
    first = exc.errors()[0]
    field = _field(tuple(first.get("loc", ())))
    if first["type"] == "json_invalid":
        return (
            "body",
            f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
        )
    if first["type"] == "extra_forbidden":
        return field, f"unknown field {field!r}; remove it (see the OpenAI API for the fields)"
    if first["type"] == "missing":
        return field, f"missing required field {field!r}"
    return field, f"{field}: {first['msg']} (got {first.get('input')!r})"


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="workbench server", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(ApiKey, key=settings.api_key)  # outermost: no body is read without the key
    tok = engine.engine.tokenizer
    max_len = engine.engine.max_model_len
    limit = engine.engine.context_limit

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        field, message = _validation_message(exc)
        return error_response(400, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(
            exc.status_code, str(exc.detail), headers=dict(exc.headers or {}) or None
        )

    @app.exception_handler(RequestError)
    async def refused(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(InvalidRequest)
    async def engine_refused(_: Request, exc: InvalidRequest) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(EngineDeadError)
    async def dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(500, str(exc))

    @app.exception_handler(ClientGone)
    async def gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(RequestFailed)
    async def failed(_: Request, exc: RequestFailed) -> JSONResponse:
        return error_response(500, str(exc))

    def admit(model: str, num_requests: int) -> str | None:
        """The adapter the request runs on (None: the base); 404 / 503 when it cannot run."""
        if model != settings.model_name and model not in engine.adapter_names():
            raise _model_not_found(model, settings.model_name)
        queued = engine.num_unfinished - engine.stats.num_running
        if queued + num_requests > settings.max_waiting:
            raise _Busy(settings.max_waiting)
        if model != settings.model_name:
            engine.metrics.observe_lora_request(model)
            return model
        return None

    @app.exception_handler(_Busy)
    async def busy(_: Request, exc: _Busy) -> JSONResponse:
        return error_response(
            503,
            f"the server is at its limit of {exc.limit} waiting requests; retry later",
            headers={"Retry-After": "1"},
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.dead is not None:
            return JSONResponse({"status": f"engine failed: {engine.dead!r}"}, 503)
        if not engine.healthy:
            status = f"the last {engine.failed_steps_in_a_row} engine steps failed"
            return JSONResponse({"status": status}, 503)
        return JSONResponse({"status": "ok"})

    @app.exception_handler(UnknownAdapter)
    async def unknown_adapter(_: Request, exc: UnknownAdapter) -> JSONResponse:
        error = _model_not_found(str(exc.args[0]), settings.model_name)
        return error_response(error.status, error.message, error.param, error.code)

    @app.exception_handler(AdapterError)
    async def bad_adapter(_: Request, exc: AdapterError) -> JSONResponse:
        return error_response(400, str(exc), "lora_path")

    @app.exception_handler(AdapterLimit)
    async def adapter_limit(_: Request, exc: AdapterLimit) -> JSONResponse:
        return error_response(409, str(exc), "lora_name", "adapter_limit")

    @app.post("/v1/load_lora_adapter")
    async def load_lora(body: LoadLoraRequest) -> dict[str, Any]:
        if body.lora_name == settings.model_name:
            raise RequestError(
                400,
                f"lora_name {body.lora_name!r} is the base model's name; pick another",
                "lora_name",
            )
        if settings.lora_root is None and not settings.allow_any_lora_path:
            raise RequestError(
                403,
                "loading adapters over HTTP is off: restart the server with --lora-root DIR "
                "(adapters load only from inside DIR) or --allow-any-lora-path",
                "lora_path",
                "lora_loading_disabled",
            )
        path = _adapter_path(body.lora_path, settings.lora_root)
        version, evicted = await engine.load_lora(
            body.lora_name, path, settings.lora_root, body.evict
        )
        return {
            "status": "loaded",
            "lora_name": body.lora_name,
            "version": version,
            "evicted": evicted,
        }

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(body: UnloadLoraRequest) -> dict[str, Any]:
        version = await engine.unload_lora(body.lora_name)
        return {"status": "unloaded", "lora_name": body.lora_name, "version": version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": settings.model_name,
            "object": "model",
            "created": now(),
            "owned_by": "workbench",
            "root": settings.model_name,
            "parent": None,
            "max_model_len": max_len,
        }
        adapters = [
            {
                "id": name,
                "object": "model",
                "created": now(),
                "owned_by": "workbench",
                "root": name,
                "parent": settings.model_name,
                "max_model_len": max_len,
            }
            for name in engine.adapter_names()
        ]
        return {"object": "list", "data": [card, *adapters]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        job = await asyncio.to_thread(completion_job, body, tok, max_len)
        job = dataclasses.replace(job, adapter=admit(body.model, len(job.params)))
        rid = completion_id()
        tracked = await add_all(engine, rid, job)
        if body.stream:
            return _stream(completion_events(engine, tok, rid, body, job, tracked))
        outputs = await collect(engine, tracked, request.is_disconnected)
        choices = [
            completion_choice(tok, i, o, job.echo, body.logprobs is not None)
            for i, o in enumerate(outputs)
        ]
        return {
            "id": rid,
            "object": "text_completion",
            "created": now(),
            "model": body.model,
            "choices": choices,
            "usage": usage(outputs, job.prompts),
        }

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        job = await asyncio.to_thread(chat_job, body, tok, max_len, limit)
        job = dataclasses.replace(job, adapter=admit(body.model, len(job.params)))
        rid = chat_id()
        tracked = await add_all(engine, rid, job)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        if body.stream:
            return _stream(chat_events(engine, rid, body, job, tracked))
        outputs = await collect(engine, tracked, request.is_disconnected)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": now(),
            "model": body.model,
            "choices": [chat_choice(tok, i, o, top_n) for i, o in enumerate(outputs)],
            "usage": usage(outputs, job.prompts),
        }

    return app


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, and an error event then [DONE] if the engine fails the request mid-stream."""
    try:
        async for event in events:
            yield event
    except (RequestFailed, EngineDeadError) as e:
        yield sse(error_body(str(e), "server_error"))
        yield sse("[DONE]")


def _stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        _guarded(events),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _model_not_found(model: str, base: str) -> RequestError:
    return RequestError(
        404,
        f"model {model!r} does not exist; this server serves {base!r} and its "
        "loaded adapters (GET /v1/models)",
        "model",
        "model_not_found",
    )


def _adapter_path(raw: str, root: Path | None) -> Path:
    """The adapter dir (relative paths from the server's working dir), refused when it is
    outside `root` once `..` and symlinks are resolved."""
    try:
        path = Path(raw).expanduser()
        resolved = path.resolve()
    except (OSError, RuntimeError, ValueError) as e:
        raise RequestError(400, f"lora_path is not a usable path ({e})", "lora_path") from None
    if root is None:
        return path
    if not resolved.is_relative_to(root.resolve()):
        raise RequestError(
            400,
            f"lora_path {raw!r} is outside the adapter root {str(root)!r}; "
            "adapters load only from inside it",
            "lora_path",
        )
    return resolved


class _Busy(Exception):
    def __init__(self, limit: int) -> None:
        self.limit = limit

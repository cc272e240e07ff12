"""How each failure becomes an HTTP answer: an OpenAI error object with the field and the fix
(4xx for the client's errors, 500 for a failed engine step), never a dead server."""

from __future__ import annotations

import reprlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.engine.llm_engine import InvalidRequest
from serve.engine.output_collector import EngineDeadError, RequestFailed, UnknownAdapter
from serve.http.middleware import error_response
from serve.http.serving import ClientGone, RequestError
from serve.http.state import Busy, model_not_found, server_state
from serve.lora.registry import AdapterError, AdapterLimit

_SHORT = reprlib.Repr()
"""Echoes a bad value in bounded work and length (a 300,000-element list is not printed)."""
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 3, 6, 6
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 80, 80, 40


def _field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


def validation_message(exc: RequestValidationError) -> tuple[str, str]:
    """(field, message) of the first problem FastAPI found in the body."""
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
    return field, f"{field}: {first['msg']} (got {_SHORT.repr(first.get('input'))})"


async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    field, message = validation_message(exc)
    return error_response(400, message, field)


async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}) or None)


async def refused(_: Request, exc: RequestError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def engine_refused(_: Request, exc: InvalidRequest) -> JSONResponse:
    return error_response(400, str(exc))


async def failed(_: Request, exc: EngineDeadError | RequestFailed) -> JSONResponse:
    return error_response(500, str(exc))


async def gone(_: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def busy(_: Request, exc: Busy) -> JSONResponse:
    return error_response(
        503,
        f"the server is at its limit of {exc.limit} waiting requests; retry later",
        headers={"Retry-After": "1"},
    )


async def unknown_adapter(request: Request, exc: UnknownAdapter) -> JSONResponse:
    error = model_not_found(str(exc.args[0]), server_state(request).settings.model_name)
    return error_response(error.status, error.message, error.param, error.code)


async def bad_adapter(_: Request, exc: AdapterError) -> JSONResponse:
    return error_response(400, str(exc), "lora_path")


async def adapter_limit(_: Request, exc: AdapterLimit) -> JSONResponse:
    return error_response(409, str(exc), "lora_name", "adapter_limit")


HANDLERS: dict[type[Exception], Any] = {
    RequestValidationError: invalid,
    StarletteHTTPException: http_error,
    RequestError: refused,
    InvalidRequest: engine_refused,
    EngineDeadError: failed,
    RequestFailed: failed,
    ClientGone: gone,
    Busy: busy,
    UnknownAdapter: unknown_adapter,
    AdapterError: bad_adapter,
    AdapterLimit: adapter_limit,
}


def add_error_handlers(app: FastAPI) -> None:
    for kind, handler in HANDLERS.items():
        app.add_exception_handler(kind, handler)

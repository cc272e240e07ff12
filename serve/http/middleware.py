"""ASGI middleware of the HTTP server: the body limit (and JSON by default) and the API key.

Both are plain ASGI callables, not `BaseHTTPMiddleware`: that one wraps `receive`, so a route
never sees `http.disconnect` and a non-streaming request whose client left would run to its end.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.http.protocol import error_body

JSON = b"application/json"


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI error object with `status` (invalid_request_error below 500)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(error_body(message, kind, param, code), status, headers=headers)


class BodyLimit:
    """413 for a body over the limit, declared or streamed (chunked). The body is read here, up
    to the limit, and replayed to the app. A POST body without a JSON content type (curl's `-d`
    sends form encoding) is read as JSON, as vLLM does: every POST route here takes JSON."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        if not headers.get(b"content-type", b"").lower().startswith(JSON):
            kept = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*kept, (b"content-type", JSON)]}
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413, f"the request body is over the limit of {self.limit} bytes", "body"
        )
        await response(scope, receive, send)


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    """A receive() that returns `messages` first, then defers to `then` (disconnect events)."""

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive


class ApiKey:
    """With a key set, every HTTP route but /health needs `Authorization: Bearer KEY`
    (compared in constant time)."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            response = error_response(
                401,
                "missing or wrong API key: send Authorization: Bearer <key>",
                code="invalid_api_key",
            )
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

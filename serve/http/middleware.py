"""ASGI middleware of the HTTP server: the body limit and shape bound (and JSON by default),
the API key, and the cross-site guard (Origin and Host checks).

All are plain ASGI callables, not `BaseHTTPMiddleware`: that one wraps `receive`, so a route
never sees `http.disconnect` and a non-streaming request whose client left would run to its end.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.http.bounds import (
    MAX_INTEGER_DIGITS,
    MAX_JSON_DEPTH,
    json_depth,
    longest_integer,
    strip_strings,
)
from serve.http.protocol import MAX_PROMPTS, error_body

JSON = b"application/json"
MAX_CONTAINERS = 8 * MAX_PROMPTS
"""JSON arrays and objects a body may hold: room for every prompt as a token list, and for the
messages, content parts, tools and schemas beside them. A body of many small lists costs its
parse (0.2 s for 300,000, on the event loop, before any field is checked) whatever the
routes then refuse, so it is refused unparsed."""


def json_containers(body: bytes) -> int:
    """The `[` and `{` of `body` outside JSON strings (a bound, not a parse: malformed JSON is
    left to the parser)."""
    if len(body) < 2 * MAX_CONTAINERS:  # too short to hold more
        return 0
    bare = strip_strings(body)
    return bare.count(b"[") + bare.count(b"{")


def _shape_problem(body: bytes) -> str | None:
    """Why a body is refused unparsed: too many or too deeply nested JSON containers, or a
    number longer than Python's parser takes (its 4,300-digit limit for integers)."""
    if (containers := json_containers(body)) > MAX_CONTAINERS:
        return (
            f"the request body holds {containers} JSON arrays and objects; at most "
            f"{MAX_CONTAINERS} (at most {MAX_PROMPTS} prompts a request): split the request"
        )
    if (
        body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH
        and (depth := json_depth(body)) > MAX_JSON_DEPTH
    ):
        return (
            f"the request body nests JSON arrays and objects {depth} deep; at most "
            f"{MAX_JSON_DEPTH}: flatten it"
        )
    if (digits := longest_integer(body)) > MAX_INTEGER_DIGITS:
        return (
            f"the request body holds a number of {digits} digits; at most "
            f"{MAX_INTEGER_DIGITS} (no field takes a number of more than 20)"
        )
    return None


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
    """413 for a body over the limit, declared or streamed (chunked); 400 for one holding more
    JSON containers than any request can use (`MAX_CONTAINERS`) or nesting them deeper than
    `MAX_JSON_DEPTH` (the parser recurses per level), both counted unparsed. The body is read here, up
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
        data = b"".join(chunks)
        if (problem := _shape_problem(data)) is not None:
            return await error_response(400, problem, "body")(scope, receive, send)
        body = {"type": "http.request", "body": data, "more_body": False}
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


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(name: str) -> bool:
    """Whether a host name (lower case, no port or brackets) is `localhost` or a literal
    loopback address (127.0.0.0/8, ::1, ::ffff:127.x.y.z). Compared as a name or an address,
    never by prefix: `127.0.0.1.rebind.example` is a DNS name any page's owner can point at
    127.0.0.1, and is not loopback."""
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _host_name(host: str) -> str:
    """The name of a Host header value: `[::1]:8000` -> `::1`, `Example.com:80` -> `example.com`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class CrossSiteGuard:
    """Refuses what a web page the user visits could send: a request whose `Origin` is neither
    this server nor an allowed origin (browsers send it on every cross-site POST, even the
    "simple" text/plain ones that skip the CORS preflight), and, on a loopback-bound server, a
    `Host` that is not a loopback name or an allowed host (DNS rebinding: a page whose domain
    now resolves to 127.0.0.1). Clients that are not browsers send no Origin and are unaffected.
    Allowed origins get CORS headers (starlette's `CORSMiddleware`, inside this guard)."""

    def __init__(
        self, app: ASGIApp, allowed_origins: str | None, allowed_hosts: str | None, bind_host: str
    ) -> None:
        self.origins = {o.strip().rstrip("/") for o in (allowed_origins or "").split(",")} - {""}
        hosts = {_host_name(h) for h in (allowed_hosts or "").split(",")} - {""}
        self.hosts: frozenset[str] | None = (
            None
            if "*" in hosts or not is_loopback(_host_name(bind_host))
            else LOOPBACK_NAMES | hosts
        )
        if self.origins:
            from starlette.middleware.cors import CORSMiddleware

            app = CORSMiddleware(
                app, allow_origins=sorted(self.origins), allow_methods=["*"], allow_headers=["*"]
            )
        self.app = app

    def problem(self, scope: Scope) -> str | None:
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        name = _host_name(host)
        if self.hosts is not None and host and not is_loopback(name) and name not in self.hosts:
            return (
                f"Host {host!r} is not a loopback name: a loopback-bound server answers "
                f"only to localhost / 127.0.0.1 / [::1]; allow it with --allowed-hosts {name}"
            )
        origin = headers.get(b"origin")
        if origin is None:
            return None
        text = origin.decode("latin-1").strip().rstrip("/")
        if "*" in self.origins or text in self.origins:
            return None
        parts = urlsplit(text)
        if host and parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower():
            return None  # same origin
        return (
            f"cross-origin request from {text!r} refused (a web page may not call this server); "
            f"allow it with --allowed-origins {text}"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (problem := self.problem(scope)) is not None:
            response = error_response(403, problem, code="forbidden_origin")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

"""What every route reads: the engine, the server's settings, and admission of a request.

Routes get the `ServerState` as a FastAPI dependency (`Server`), so each route is a plain
function over typed values, and `build_app` only wires them. Everything here runs on the event
loop and reaches the engine only through `AsyncEngine` (its snapshots and queued calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from serve.core.config import Positive, Size, check_fields
from serve.engine.async_engine import AsyncEngine
from serve.http.serving import RequestError


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    """The name clients put in `model`."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` on every route but /health (the command line reads
    $WORKBENCH_API_KEY when the flag is absent; prefer it: a flag is visible to every user in
    `ps`)."""
    max_waiting: Positive = 256
    """Queued (not yet running) requests beyond which new ones get 503 with Retry-After."""
    max_body_bytes: Annotated[int, Size()] = 4 << 20
    """Largest accepted request body; larger ones get 413."""
    lora_root: Path | None = None
    """Allow POST /v1/load_lora_adapter from inside this directory only (no `..` or symlink
    escape, for every file read)."""
    allow_any_lora_path: bool = False
    """Allow POST /v1/load_lora_adapter from any path the server can read (without this or
    `lora_root`, loading adapters over HTTP is refused)."""
    allowed_origins: str | None = None
    """Comma-separated browser origins allowed to call the API (CORS), e.g.
    http://localhost:3000, or * for any; a request from any other page is refused (403)."""
    allowed_hosts: str | None = None
    """Comma-separated Host names accepted besides the loopback ones when the server is bound
    to loopback (a DNS-rebinding guard), e.g. the name a proxy forwards; * accepts any."""
    bind_host: str = "127.0.0.1"
    """The address the server is bound to (`--host`): the Host check applies on loopback."""
    chat_template: str | None = None
    """A Jinja chat template, or a file holding one, used instead of the model's."""
    max_unread_tokens: Positive = 4096
    """Tokens a streaming client may fall behind before its request is aborted (counted
    with finish reason slow_reader): bounds what one stream holds on the server."""

    def __post_init__(self) -> None:
        check_fields(self)


class Busy(Exception):
    """The waiting queue is full: 503 with Retry-After."""

    def __init__(self, limit: int) -> None:
        self.limit = limit


def model_not_found(model: str, base: str) -> RequestError:
    return RequestError(
        404,
        f"model {model!r} does not exist; this server serves {base!r} and its "
        "loaded adapters (GET /v1/models)",
        "model",
        "model_not_found",
    )


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the template itself (as vLLM takes it)."""
    if value is None:
        return None
    path = Path(value)
    if "{" not in value and "\n" not in value:
        try:
            return path.read_text()
        except OSError as e:
            raise ValueError(
                f"--chat-template {value!r}: cannot read it as a file ({e.strerror}) and it is "
                "not a Jinja template; give a template file or the template text"
            ) from None
    return value


@dataclass(frozen=True)
class ServerState:
    engine: AsyncEngine
    settings: ServerSettings
    chat_template: str | None = None
    """The --chat-template's text (None: the tokenizer's own)."""

    def check_model(self, model: str) -> None:
        """404 unless `model` is the base or a loaded adapter."""
        base = self.settings.model_name
        if model != base and model not in self.engine.adapter_names():
            raise model_not_found(model, base)

    def check_room(self, model: str, num_requests: int) -> None:
        """404 / 503 now, before any work, when the request could not be admitted (each of its
        prompts x `n` choices counts as a request); `admit`
        decides (again) when the requests are added, with nothing awaited in between."""
        self.check_model(model)
        engine = self.engine
        queued = engine.num_unfinished - engine.stats.num_running
        if queued + num_requests > self.settings.max_waiting:
            raise Busy(self.settings.max_waiting)

    def admit(self, model: str, num_requests: int) -> str | None:
        """The adapter the request runs on (None: the base); 404 / 503 when it cannot run."""
        self.check_room(model, num_requests)
        if model != self.settings.model_name:
            self.engine.metrics.observe_lora_request(model)
            return model
        return None


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


Server = Annotated[ServerState, Depends(server_state)]
"""A route's parameter type for the server's state."""

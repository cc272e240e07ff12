"""What the server keeps per request between the engine thread and its reader.

Model: a collector holds at most one unread output: deltas (streams) are merged into it, a
final output replaces it, and an error, once put, is what the reader gets next (never replaced).
So a request holds one output's worth of memory however far behind its reader is.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from serve.core.sampling_params import OutputKind
from serve.engine.output_processor import RequestOutput


class UnknownAdapter(LookupError):
    """A request names an adapter that is not loaded."""


class EngineDeadError(RuntimeError):
    """The engine thread failed; the server answers 500 and must be restarted."""


class RequestFailed(RuntimeError):
    """The step computing this request failed; the request is ended, the engine serves on."""


class ReaderTooSlow(RuntimeError):
    """The client fell too far behind its stream; the request was aborted."""


class OutputCollector:
    """The outputs of one request not read yet, kept as one (vLLM's output collector)."""

    def __init__(self, kind: OutputKind) -> None:
        self.kind = kind
        self.item: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def fail(self, error: BaseException) -> None:
        """Drop the unread output: the reader gets `error` next."""
        self.item = None
        self.put(error)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Merge a delta into the unread one, else replace it; an error is never replaced."""
        held = self.item
        if isinstance(held, BaseException):
            return
        if held is not None and isinstance(item, RequestOutput) and self.kind is OutputKind.DELTA:
            item = held.merge(item)
        self.item = item
        self.ready.set()

    @property
    def unread_tokens(self) -> int:
        held = self.item
        return len(held.token_ids) if isinstance(held, RequestOutput) else 0

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        item, self.item = self.item, None
        self.ready.clear()
        if isinstance(item, BaseException):
            raise item
        assert item is not None
        return item


@dataclass
class Tracked:
    """One request as the server sees it: its unread output and timing."""

    request_id: str
    collector: OutputCollector
    arrival: float
    num_prompt_tokens: int
    last_token_at: float | None = None
    num_tokens: int = 0
    finished: bool = False

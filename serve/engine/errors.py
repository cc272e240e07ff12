"""What the engine raises to its clients."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses when it is added; the message names the limit."""


class StepFailed(RuntimeError):
    """One step failed; the requests it had scheduled are aborted (blocks freed), no others."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"a step of {len(request_ids)} request(s) failed: {cause!r}")
        self.request_ids, self.cause = request_ids, cause

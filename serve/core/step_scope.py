"""A value that holds for the duration of one step's forward pass, on the calling thread.

The engine's forward contexts (attention metadata, the step's LoRA slots) are `ContextVar`s set
by exactly one `with step_scope(var, value)` in the model runner, so the model's own call stays
tensors only (vLLM's forward context). A new thread starts without one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")


@contextmanager
def step_scope(var: ContextVar[T], value: T) -> Iterator[None]:
    """`var` is `value` inside the block, and what it was before after it."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)

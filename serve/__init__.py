"""The paged-KV continuous-batching engine and its Python API.

The names below load on first use (PEP 562), so importing an engine-core module such as
`serve.block_pool` or `serve.scheduler` does not load torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve.engine import InvalidRequest, LLMEngine, RequestOutput
    from serve.llm import LLM, Completion
    from serve.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "serve.llm",
    "Completion": "serve.llm",
    "InvalidRequest": "serve.engine",
    "LLMEngine": "serve.engine",
    "RequestOutput": "serve.engine",
    "SamplingParams": "serve.sampling_params",
}
__all__ = ["LLM", "Completion", "InvalidRequest", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

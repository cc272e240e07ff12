"""The paged-KV continuous-batching engine and its Python API.

The names below load on first use (PEP 562), so importing an engine-core module such as
`serve.core.block_pool` or `serve.core.scheduler` does not load torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve.core.sampling_params import SamplingParams
    from serve.engine.llm import LLM, Completion
    from serve.engine.llm_engine import InvalidRequest, LLMEngine, RequestOutput

_EXPORTS = {
    "LLM": "serve.engine.llm",
    "Completion": "serve.engine.llm",
    "InvalidRequest": "serve.engine.llm_engine",
    "LLMEngine": "serve.engine.llm_engine",
    "RequestOutput": "serve.engine.llm_engine",
    "SamplingParams": "serve.core.sampling_params",
}
__all__ = ["LLM", "Completion", "InvalidRequest", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

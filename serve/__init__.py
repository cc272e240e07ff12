"""The paged-KV continuous-batching engine and its Python API."""

from serve.engine import InvalidRequest, LLMEngine, RequestOutput
from serve.llm import LLM, Completion
from serve.sampling_params import SamplingParams

__all__ = ["LLM", "Completion", "InvalidRequest", "LLMEngine", "RequestOutput", "SamplingParams"]

"""The paged-KV continuous-batching engine and its OpenAI-compatible server."""

"""The engine: `LLMEngine` (schedule, execute, sample, detokenize), `AsyncEngine` (the engine on
its own thread, driven from asyncio), `LLM` (the offline API) and the Prometheus metrics."""

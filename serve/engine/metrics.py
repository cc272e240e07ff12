"""Prometheus metrics, named like vLLM's under a `workbench:` prefix, in a registry of their own.

Request-level figures (TTFT, inter-token latency, end-to-end latency, tokens, finish reasons) are
observed as outputs reach their requests; engine-level gauges and counters are refreshed from the
engine's stats snapshot after every step.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serve.core.stats import EngineStats

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


KV_FULL = 0.9
"""KV usage at or above which waiting requests count as queueing for the cache."""


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = self._histogram("inter_token_latency_seconds", "Time between two output tokens.")
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.running = self._gauge("num_requests_running", "Requests computing.")
        self.waiting = self._gauge("num_requests_waiting", "Requests queued.")
        self.kv_usage = self._gauge("kv_cache_usage_perc", "Used KV blocks / all (0-1).")
        self.blocks_free = self._gauge("kv_cache_free_blocks", "Free KV blocks.")
        self.blocks_total = self._gauge("kv_cache_total_blocks", "All KV blocks.")
        self.prefix_queries = self._counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.preemptions = self._counter("num_preemptions", "Requests preempted.")
        self.kv_full_queued = self._counter(
            "kv_cache_full_queued_steps",
            f"Engine steps that ended with requests waiting while the KV cache was at least "
            f"{KV_FULL:.0%} full (the load benchmark's saturation signal).",
        )
        self.decode_paths = self._counter(
            "step_paths",
            "Engine steps by path once decode graphs are captured: graph (replayed) or "
            "eager:<reason> (prefill, batch_size, lora).",
            "path",
        )
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens.")
        self.finished = self._counter(
            "request_success", "Finished requests by finish reason.", "finished_reason"
        )
        self.cache_info = self._gauge(
            "cache_config_info",
            "KV cache layout (labels); value 1.",
            "block_size",
            "num_blocks",
            "kv_bytes_per_token",
        )
        self.lora_loaded = self._gauge("lora_loaded_adapters", "Adapters loaded.")
        self.lora_requests = self._counter("lora_requests", "Requests per adapter.", "adapter")
        self.lora_load = self._histogram(
            "lora_load_seconds", "Adapter load time (read + register)."
        )
        self._last = EngineStats(0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0)

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(
            f"workbench:{name}",
            doc,
            ["model_name"],
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(f"workbench:{name}", doc, ["model_name", *labels], registry=self.registry)

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(f"workbench:{name}", doc, ["model_name", *labels], registry=self.registry)

    def describe_cache(self, block_size: int, num_blocks: int, bytes_per_token: int) -> None:
        labels = (self.model_name, str(block_size), str(num_blocks), str(bytes_per_token))
        self.cache_info.labels(*labels).set(1)

    def observe_stats(self, s: EngineStats, step: bool = True) -> None:
        """Refresh the gauges; `step`: `s` is the state after an engine step (not after aborts
        between steps), which the KV-full counter counts."""
        m = self.model_name
        self.running.labels(m).set(s.num_running)
        self.waiting.labels(m).set(s.num_waiting)
        self.kv_usage.labels(m).set(s.kv_usage)
        self.blocks_free.labels(m).set(s.num_blocks_free)
        self.blocks_total.labels(m).set(s.num_blocks_used + s.num_blocks_free)
        self.prefix_queries.labels(m).inc(s.prefix_cache_queries - self._last.prefix_cache_queries)
        self.prefix_hits.labels(m).inc(s.prefix_cache_hits - self._last.prefix_cache_hits)
        self.preemptions.labels(m).inc(s.num_preemptions - self._last.num_preemptions)
        before = dict(self._last.decode_paths)
        for path, count in s.decode_paths:
            self.decode_paths.labels(m, path).inc(count - before.get(path, 0))
        if step and s.num_waiting > 0 and s.kv_usage >= KV_FULL:
            self.kv_full_queued.labels(m).inc()
        self._last = s

    def observe_token(self, first: bool, seconds: float, num_tokens: int) -> None:
        (self.ttft if first else self.itl).labels(self.model_name).observe(seconds)
        self.generation_tokens.labels(self.model_name).inc(num_tokens)

    def observe_finish(self, reason: str, prompt_tokens: int, seconds: float) -> None:
        self.finished.labels(self.model_name, reason).inc()
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.e2e.labels(self.model_name).observe(seconds)

    def observe_lora_load(self, seconds: float | None, loaded: int) -> None:
        if seconds is not None:
            self.lora_load.labels(self.model_name).observe(seconds)
        self.lora_loaded.labels(self.model_name).set(loaded)

    def observe_lora_request(self, adapter: str) -> None:
        self.lora_requests.labels(self.model_name, adapter).inc()

    def forget_adapter(self, adapter: str) -> None:
        """Drop an unloaded adapter's series, so the label set stays bounded by the adapters
        loaded (at most --max-cpu-loras)."""
        with contextlib.suppress(KeyError):
            self.lora_requests.remove(self.model_name, adapter)

    def render(self) -> bytes:
        return generate_latest(self.registry)

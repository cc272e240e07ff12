"""Load benchmark over HTTP: ramp concurrency for each prompt length against a running server.

Model: at each point (concurrency c, prompt length p) c clients each send streaming completions
back to back (random token-id prompts of p tokens, exactly `max_tokens` outputs, eos ignored)
until `requests` have finished. Per request: TTFT, time per output token after the first, and
end-to-end latency; per point: request and token throughput, p50/p95/p99, and the peaks of KV
usage and waiting requests sampled from `/metrics` while the point runs, and the increase of its
counters. The saturation point is the first concurrency at which requests queue while the KV
cache is at least 90% full, read exactly from `workbench:kv_cache_full_queued_steps` (engine
steps that ended that way); it is compared with the estimate `KV tokens / (p + max_tokens)` from
the server's KV budget.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from evals.results import LoadResult, Percentiles, Point, Saturation, ServerInfo


@dataclass(frozen=True)
class RequestTiming:
    ttft: float
    tpot: float
    """Mean seconds per output token after the first."""
    e2e: float
    output_tokens: int


def percentiles(values: list[float]) -> Percentiles:
    if not values:
        nan = float("nan")
        return Percentiles(p50=nan, p95=nan, p99=nan, mean=nan)
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return Percentiles(p50=q[49], p95=q[94], p99=q[98], mean=statistics.fmean(values))


def read_metrics(text: str) -> dict[str, float]:
    """Sample name -> value summed over labels; label values of `*_info` samples as `name.label`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            if sample.name.endswith("_info"):
                for label, value in sample.labels.items():
                    if value.isdigit():
                        out[f"{sample.name}.{label}"] = float(value)
    return out


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestTiming:
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first or last
    end = time.perf_counter()
    first = first or end
    tpot = ((last or end) - first) / max(tokens - 1, 1)
    return RequestTiming(first - start, tpot, end - start, tokens)


COUNTERS = ("workbench:num_preemptions_total", "workbench:kv_cache_full_queued_steps_total")
GAUGES = {
    "kv": ("workbench:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"),
    "waiting": ("workbench:num_requests_waiting", "vllm:num_requests_waiting"),
}
"""Gauges by the names this server and vLLM export; other servers: 0 (not measured)."""


def gauge(m: dict[str, float], kind: str) -> float:
    return next((m[name] for name in GAUGES[kind] if name in m), 0.0)


def metrics_of(response: httpx.Response) -> dict[str, float]:
    """A /metrics response of a server that may not export Prometheus text there: {} then."""
    if response.status_code != 200:
        return {}
    try:
        return read_metrics(response.text)
    except ValueError:
        return {}


class MetricsWatcher:
    """Polls /metrics while a point runs: peaks of the gauges (sampled every 0.1 s, so a peak
    shorter than that can be missed) and the counters' increase over the point (exact)."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client, self.url = client, url
        self.peak_kv = self.peak_waiting = 0.0
        self.start: dict[str, float] = {}
        self.end: dict[str, float] = {}

    async def sample(self) -> dict[str, float]:
        m = metrics_of(await self.client.get(f"{self.url}/metrics"))
        self.peak_kv = max(self.peak_kv, gauge(m, "kv"))
        self.peak_waiting = max(self.peak_waiting, gauge(m, "waiting"))
        return m

    async def watch(self, stop: asyncio.Event) -> None:
        m = await self.sample()
        self.start = {c: m.get(c, 0.0) for c in COUNTERS}
        while not stop.is_set():
            await asyncio.sleep(0.1)
            await self.sample()
        m = await self.sample()  # after the last request: the counters are complete
        self.end = {c: m.get(c, 0.0) for c in COUNTERS}

    def increase(self, counter: str) -> float:
        return self.end.get(counter, 0.0) - self.start.get(counter, 0.0)


PROMPT_TOKEN_RANGE = (10, 500)
"""Prompt token ids are drawn from here: valid for any vocabulary of 500 tokens or more."""


async def run_point(
    url: str, model: str, c: int, p: int, max_tokens: int, requests: int, seed: int = 0
) -> Point:
    rng = random.Random(seed * 1000 + c * 7 + p)
    prompts = [[rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(p)] for _ in range(requests)]
    timings: list[RequestTiming] = []
    failed = 0
    limits = httpx.Limits(max_connections=c + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        watcher, stop = MetricsWatcher(client, url), asyncio.Event()
        watch_task = asyncio.ensure_future(watcher.watch(stop))
        queue = list(range(requests))

        async def worker() -> None:
            nonlocal failed
            while queue:
                body = {
                    "model": model,
                    "prompt": prompts[queue.pop()],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                try:
                    timings.append(await one_request(client, url, body))
                except (RuntimeError, httpx.HTTPError):
                    failed += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        seconds = time.perf_counter() - start
        stop.set()
        await watch_task
    tokens = sum(t.output_tokens for t in timings)
    queued = watcher.increase(COUNTERS[1])
    return Point(
        concurrency=c,
        prompt_len=p,
        max_tokens=max_tokens,
        requests=len(timings),
        seconds=seconds,
        request_throughput=len(timings) / seconds,
        output_throughput=tokens / seconds,
        ttft=percentiles([t.ttft for t in timings]),
        tpot=percentiles([t.tpot for t in timings]),
        e2e=percentiles([t.e2e for t in timings]),
        peak_kv_usage=watcher.peak_kv,
        peak_waiting=watcher.peak_waiting,
        preemptions=watcher.increase(COUNTERS[0]),
        kv_full_queued_steps=queued,
        failed=failed,
        saturated=queued > 0,
    )


def server_info(url: str) -> ServerInfo:
    """The served model and, from this server's metrics, its KV cache; any other
    OpenAI-compatible server (vLLM, ...) gets None where it does not say."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    m = metrics_of(httpx.get(f"{url}/metrics", timeout=30))
    info = "workbench:cache_config_info"
    return ServerInfo(
        model=model["id"],
        max_model_len=model.get("max_model_len"),
        kv_blocks=m.get(f"{info}.num_blocks"),
        block_size=m.get(f"{info}.block_size"),
        kv_bytes_per_token=m.get(f"{info}.kv_bytes_per_token"),
    )


def sweep(
    url: str,
    concurrency: list[int],
    prompt_lens: list[int],
    max_tokens: int,
    requests_per_point: int | None = None,
    model: str | None = None,
    requests_per_client: int = 2,
) -> LoadResult:
    """All points, with the saturation point per prompt length and its estimate. `model` is
    the name requests send (default: the server's base model; an adapter's name measures it)."""
    info = server_info(url)
    if model is not None:
        info = info.model_copy(update={"model": model})
    blocks, block_size = info.kv_blocks, info.block_size
    kv_tokens = blocks * block_size if blocks is not None and block_size is not None else None
    points: list[Point] = []
    saturation: dict[str, Saturation] = {}
    with tqdm(
        total=len(concurrency) * len(prompt_lens), desc=f"load {info.model}", unit="point"
    ) as bar:
        for p in prompt_lens:
            for c in concurrency:
                n = requests_per_point or max(requests_per_client * c, 8)
                points.append(asyncio.run(run_point(url, info.model, c, p, max_tokens, n)))
                bar.set_postfix(c=c, p=p, tok_s=f"{points[-1].output_throughput:.0f}")
                bar.update()
            saturated = (pt.concurrency for pt in points if pt.prompt_len == p and pt.saturated)
            saturation[str(p)] = Saturation(
                measured_concurrency=next(saturated, None),
                estimated_concurrency=kv_tokens / (p + max_tokens) if kv_tokens else None,
            )
    return LoadResult(server=info, kv_tokens=kv_tokens, points=points, saturation=saturation)

"""Load benchmark over HTTP: ramp concurrency for each prompt length against a running server,
and open-loop points at given request rates.

Model: at each closed-loop point (concurrency c, prompt length p) c clients each send streaming
completions back to back (random token-id prompts of p tokens, exactly `max_tokens` outputs, eos
ignored) until `requests` have finished. An open-loop point sends the same requests at Poisson
arrival times of a given rate (seeded), whether or not earlier ones finished, as
`vllm bench serve --request-rate` does; its `concurrency` is the most requests in flight at once.
Per request: TTFT, time per output token after the first, end-to-end latency and the gaps between
streamed tokens (inter-token latency); per point: request and token throughput, p50/p95/p99
(ITL over every gap of every request), and the peaks of KV
usage and waiting requests sampled from `/metrics` while the point runs, and the increase of its
counters. The saturation point is the first concurrency at which requests queue while the KV
cache is at least 90% full, read exactly from `workbench:kv_cache_full_queued_steps` (engine
steps that ended that way); it is compared with the estimate `KV tokens / (p + max_tokens)` from
the server's KV budget.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import itertools
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from evals.results import (
    Capacity,
    LoadResult,
    Percentiles,
    Point,
    Saturation,
    ServerInfo,
    Sitting,
)
from evals.settings import LoadEval


@dataclass(frozen=True)
class RequestTiming:
    ttft: float
    tpot: float
    """Mean seconds per output token after the first."""
    e2e: float
    output_tokens: int
    itl: tuple[float, ...] = ()
    """Seconds between consecutive streamed tokens."""


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
    arrivals: list[float] = []
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
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    first = arrivals[0] if arrivals else end
    tpot = ((arrivals[-1] if arrivals else end) - first) / max(tokens - 1, 1)
    itl = tuple(b - a for a, b in itertools.pairwise(arrivals))
    return RequestTiming(first - start, tpot, end - start, tokens, itl)


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


Send = Callable[[int], Awaitable[None]]
"""Sends request i and waits for its end."""


def closed_loop(concurrency: int, requests: int) -> Callable[[Send], Awaitable[None]]:
    """`concurrency` clients, each sending its next request when its last one ended."""

    async def drive(send: Send) -> None:
        queue = list(range(requests))

        async def client() -> None:
            while queue:
                await send(queue.pop())

        await asyncio.gather(*(client() for _ in range(concurrency)))

    return drive


def poisson_arrivals(rate: float, requests: int, seed: int) -> Callable[[Send], Awaitable[None]]:
    """Request i sent at the i-th arrival of a Poisson process of `rate` per second (seeded
    exponential gaps), whatever is still in flight."""

    async def drive(send: Send) -> None:
        rng = random.Random(seed)
        start, at, sent = time.perf_counter(), 0.0, []
        for i in range(requests):
            at += rng.expovariate(rate)
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent.append(asyncio.ensure_future(send(i)))
        await asyncio.gather(*sent)

    return drive


async def measure_point(
    url: str,
    model: str,
    p: int,
    max_tokens: int,
    requests: int,
    drive: Callable[[Send], Awaitable[None]],
    seed: int,
    connections: int,
) -> Point:
    """The point of `requests` sent as `drive` says; its `concurrency` is the most requests in
    flight at once (a closed-loop caller sets its client count)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(*PROMPT_TOKEN_RANGE) for _ in range(p)] for _ in range(requests)]
    timings: list[RequestTiming] = []
    failed = in_flight = most = 0
    limits = httpx.Limits(max_connections=connections + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        watcher, stop = MetricsWatcher(client, url), asyncio.Event()
        watch_task = asyncio.ensure_future(watcher.watch(stop))

        async def send(i: int) -> None:
            nonlocal failed, in_flight, most
            body = {
                "model": model,
                "prompt": prompts[i],
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            in_flight += 1
            most = max(most, in_flight)
            try:
                timings.append(await one_request(client, url, body))
            except (RuntimeError, httpx.HTTPError):
                failed += 1
            finally:
                in_flight -= 1

        start = time.perf_counter()
        await drive(send)
        seconds = time.perf_counter() - start
        stop.set()
        await watch_task
    tokens = sum(t.output_tokens for t in timings)
    queued = watcher.increase(COUNTERS[1])
    return Point(
        concurrency=most,
        prompt_len=p,
        max_tokens=max_tokens,
        requests=len(timings),
        seconds=seconds,
        request_throughput=len(timings) / seconds,
        output_throughput=tokens / seconds,
        ttft=percentiles([t.ttft for t in timings]),
        tpot=percentiles([t.tpot for t in timings]),
        e2e=percentiles([t.e2e for t in timings]),
        itl=percentiles([gap for t in timings for gap in t.itl]),
        peak_kv_usage=watcher.peak_kv,
        peak_waiting=watcher.peak_waiting,
        preemptions=watcher.increase(COUNTERS[0]),
        kv_full_queued_steps=queued,
        failed=failed,
        saturated=queued > 0,
    )


async def run_point(
    url: str, model: str, c: int, p: int, max_tokens: int, requests: int, seed: int = 0
) -> Point:
    """A closed-loop point: `c` clients."""
    drive = closed_loop(c, requests)
    point = await measure_point(
        url, model, p, max_tokens, requests, drive, seed * 1000 + c * 7 + p, c
    )
    return point.model_copy(update={"concurrency": c})


async def run_rate_point(
    url: str, model: str, rate: float, p: int, max_tokens: int, requests: int, seed: int = 0
) -> Point:
    """An open-loop point: Poisson arrivals at `rate` requests per second."""
    drive = poisson_arrivals(rate, requests, seed * 1000 + p)
    point = await measure_point(
        url, model, p, max_tokens, requests, drive, seed * 1000 + p, requests
    )
    return point.model_copy(update={"request_rate": rate})


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


def sweep(url: str, load: LoadEval, model: str | None = None) -> LoadResult:
    """The ramp's points with the saturation point per prompt length and its estimate, the
    open-loop points at `load.request_rates`, and with `load.slo` each prompt length's capacity
    (`evals.capacity`). `model` is the name requests send (default: the server's base model; an
    adapter's name measures it)."""
    from evals.capacity import capacity

    began, started = datetime.datetime.now(datetime.UTC), time.perf_counter()
    info = server_info(url)
    if model is not None:
        info = info.model_copy(update={"model": model})
    blocks, block_size = info.kv_blocks, info.block_size
    kv_tokens = blocks * block_size if blocks is not None and block_size is not None else None
    points: list[Point] = []
    rate_points: list[Point] = []
    saturation: dict[str, Saturation] = {}
    capacities: dict[str, Capacity] = {}
    per_length = len(load.concurrency) + len(load.request_rates)
    per_length += load.slo_search_steps if load.slo else 0
    with tqdm(
        total=per_length * len(load.prompt_len), desc=f"load {info.model}", unit="point"
    ) as bar:

        def done(point: Point) -> Point:
            what = f"{point.request_rate:g}/s" if point.request_rate else point.concurrency
            bar.set_postfix(at=what, p=point.prompt_len, tok_s=f"{point.output_throughput:.0f}")
            bar.update()
            return point

        def at_rate(rate: float, p: int) -> Point:
            n = load.requests_per_rate_point
            return done(asyncio.run(run_rate_point(url, info.model, rate, p, load.max_tokens, n)))

        for p in load.prompt_len:
            ramp = []
            for c in load.concurrency:
                n = load.requests_per_point or max(load.requests_per_client * c, 8)
                ramp.append(done(asyncio.run(run_point(url, info.model, c, p, load.max_tokens, n))))
            points += ramp
            saturated = (pt.concurrency for pt in ramp if pt.saturated)
            saturation[str(p)] = Saturation(
                measured_concurrency=next(saturated, None),
                estimated_concurrency=kv_tokens / (p + load.max_tokens) if kv_tokens else None,
            )
            rate_points += [at_rate(rate, p) for rate in load.request_rates]
            if load.slo:
                search = functools.partial(at_rate, p=p)
                found = capacity(ramp, load.slo, search, load.slo_search_steps)
                capacities[str(p)] = found
                bar.total -= load.slo_search_steps - len(found.searched)  # stopped at the peak
                bar.refresh()
    return LoadResult(
        server=info,
        kv_tokens=kv_tokens,
        points=points,
        saturation=saturation,
        rate_points=rate_points or None,
        capacity=capacities or None,
        measured=Sitting.since(began, time.perf_counter() - started),
    )

"""Capacity under a latency SLO: how much traffic a served variant takes while its p95s stay in
bounds (the question `vllm bench serve --goodput` and GuideLLM's sweeps answer).

Model: a point meets the SLO when none of its requests failed and each bound given holds for
its 95th percentile (TTFT, inter-token latency, end-to-end). On the closed-loop ramp the capacity
is the highest concurrency whose point meets it. Over request rates it is searched: open-loop
points at Poisson rates, starting from `start`, doubling while points meet the SLO and halving
while they do not, then bisecting between the highest rate that met it and the lowest that did
not. With a ramp, `start` is its peak request throughput and also the ceiling: a rate above what
the server completes at any concurrency only queues, so it cannot be sustained, even when a
short point's burst of requests still finishes within the SLO (16 requests offered at 26/s to a
server that completes 7/s all arrive before the first finishes; they meet a 1 s TTFT bound, and
the queue would grow without bound under that rate). A point at the ceiling that meets the SLO
ends the search. Latency grows with the rate (more requests share each engine step), which the
bisection assumes; the points measured are kept so a reader can see the curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from evals.results import Capacity, Point
from evals.settings import Slo


def observed(point: Point) -> dict[str, float]:
    """A point's p95s under the SLO's names (ITL: nan when the server streamed no gaps)."""
    return {
        "ttft_p95_s": point.ttft.p95,
        "itl_p95_s": point.itl.p95 if point.itl else math.nan,
        "e2e_p95_s": point.e2e.p95,
    }


def meets(point: Point, slo: Slo) -> bool:
    if point.failed or point.requests == 0:
        return False
    seen = observed(point)
    return all(seen[name] <= bound for name, bound in slo.bounds().items())


def max_concurrency(points: list[Point], slo: Slo) -> int | None:
    met = [p.concurrency for p in points if p.request_rate is None and meets(p, slo)]
    return max(met) if met else None


def search_rate(
    measure: Callable[[float], Point],
    slo: Slo,
    start: float,
    steps: int,
    ceiling: float = math.inf,
) -> tuple[float | None, list[Point]]:
    """(the highest measured rate meeting `slo`, every point measured): at most `steps` points,
    none above `ceiling`."""
    good: float | None = None
    bad: float | None = None
    rate, points = min(start, ceiling), []
    for _ in range(steps):
        point = measure(rate)
        points.append(point)
        if meets(point, slo):
            good = rate
            if rate >= ceiling:
                break
            rate = min(rate * 2, ceiling) if bad is None else (rate + bad) / 2
        else:
            bad = rate
            rate = rate / 2 if good is None else (good + rate) / 2
    return good, points


def capacity(
    ramp: list[Point], slo: Slo, measure: Callable[[float], Point], steps: int
) -> Capacity:
    """One prompt length's capacity: from its ramp points, and a rate search started at the
    ramp's peak request throughput and kept at or below it (from 1 req/s, unbounded, without a
    ramp)."""
    peak = max((p.request_throughput for p in ramp if p.requests), default=None)
    start, ceiling = (1.0, math.inf) if peak is None else (peak, peak)
    rate, searched = search_rate(measure, slo, start, steps, ceiling)
    return Capacity(
        slo=slo.bounds(),
        concurrency=max_concurrency(ramp, slo),
        request_rate=rate,
        searched=searched,
    )

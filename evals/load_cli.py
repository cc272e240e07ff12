"""`workbench bench`: the load benchmark against a running server, or one it starts."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from evals.load import sweep
from evals.results import LoadResult


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give comma-separated integers, e.g. 1,4,16"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="a model/variant to serve for the run (or use --url)")
    p.add_argument(
        "--url", help="benchmark this running server instead, e.g. http://127.0.0.1:8000"
    )
    p.add_argument(
        "--concurrency",
        type=_ints,
        default=[1, 2, 4, 8, 16, 32, 64, 128],
        help="concurrent clients to ramp through (default 1,2,4,...,128)",
    )
    p.add_argument(
        "--prompt-len", type=_ints, default=[64, 256, 1024], help="prompt lengths in tokens"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    p.add_argument(
        "--requests",
        type=int,
        help="requests per point (default: max(--requests-per-client x concurrency, 8))",
    )
    p.add_argument(
        "--requests-per-client", type=int, default=2, help="requests each client sends (default 2)"
    )
    p.add_argument(
        "--request-model",
        help="the `model` requests name (default: the server's base model); e.g. an adapter "
        "loaded with --lora NAME=PATH",
    )
    p.add_argument("--out", default="reports/bench.json", help="JSON results file")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(model: str, serve_flags: list[str], log: Path) -> Iterator[str]:
    """`python -m serve MODEL` in a subprocess on a free port; yields its URL. The server is
    this process's own (loopback, a port nobody else was told): the API key a user exports for
    their servers ($WORKBENCH_API_KEY) is not passed on, or it would lock out our own requests."""
    from serve.http.cli import API_KEY_ENV

    port = _free_port()
    cmd = [sys.executable, "-m", "serve", model, "--port", str(port), *serve_flags]
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start in 10 minutes; see {log}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run_bench(args: argparse.Namespace, serve_flags: list[str]) -> LoadResult:
    if bool(args.url) == bool(args.model):
        raise SystemExit(
            "workbench bench: give a MODEL to serve or --url of a running server, not both"
        )
    out = Path(args.out)

    def run(url: str) -> LoadResult:
        return sweep(
            url,
            args.concurrency,
            args.prompt_len,
            args.max_tokens,
            args.requests,
            model=args.request_model,
            requests_per_client=args.requests_per_client,
        )

    if args.url:
        result = run(args.url)
    else:
        with served(args.model, serve_flags, out.with_suffix(".server.log")) as url:
            result = run(url)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.to_json(), indent=2))
    return result


def print_summary(result: LoadResult) -> None:
    print(
        f"{'conc':>5} {'prompt':>6} {'req/s':>7} {'tok/s':>8} {'ttft p50':>9} {'ttft p95':>9} "
        f"{'e2e p50':>8} {'e2e p95':>8} {'kv peak':>7} {'wait pk':>7}"
    )
    for p in result.points:
        print(
            f"{p.concurrency:>5} {p.prompt_len:>6} {p.request_throughput:>7.2f} "
            f"{p.output_throughput:>8.1f} {p.ttft.p50:>9.3f} {p.ttft.p95:>9.3f} "
            f"{p.e2e.p50:>8.3f} {p.e2e.p95:>8.3f} {p.peak_kv_usage:>7.2f} "
            f"{p.peak_waiting:>7.0f}"
        )
    for length, sat in result.saturation.items():
        estimate = sat.estimated_concurrency
        print(
            f"prompt {length}: saturation at concurrency {sat.measured_concurrency} "
            f"(estimate from KV budget: {'unknown' if estimate is None else f'{estimate:.1f}'})"
        )

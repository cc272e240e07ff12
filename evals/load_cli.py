"""`workbench bench`: the load benchmark against a running server, or one it starts."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from pydantic import ValidationError

from evals.load import sweep
from evals.results import LoadResult
from evals.settings import LoadEval, Slo

SLO_KEYS = {"ttft": "ttft_p95_s", "itl": "itl_p95_s", "e2el": "e2e_p95_s"}
"""`--slo` keys (vllm bench serve's metric names) and the recipe's `slo` fields."""


def _positive_list(kind: type, example: str) -> Callable[[str], list]:
    """An argparse type: comma-separated positive, finite numbers of `kind`."""
    noun = "integers" if kind is int else "numbers"

    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give comma-separated {noun}, e.g. {example}"
            ) from None
        if not values or any(not 0 < v < float("inf") for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: give positive, finite {noun}")
        return values

    return parse


_ints = _positive_list(int, "1,4,16")
_floats = _positive_list(float, "0.5,1,2")


def _slo_bound(text: str) -> tuple[str, float]:
    key, _, ms = text.partition(":")
    if key not in SLO_KEYS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give KEY:MILLISECONDS with KEY one of {', '.join(SLO_KEYS)}, e.g. ttft:500"
        )
    try:
        value = float(ms)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the bound must be positive milliseconds")
    return SLO_KEYS[key], value / 1000


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
    p.add_argument(
        "--request-rate",
        type=_floats,
        default=[],
        help="open-loop points: Poisson arrivals at these rates (requests/s), e.g. 1,2,4",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=32,
        help="requests per open-loop point, the SLO search's too (default 32)",
    )
    p.add_argument(
        "--slo",
        type=_slo_bound,
        nargs="+",
        metavar="KEY:MS",
        help="find the capacity within these p95 bounds in milliseconds (keys ttft, itl, e2el), "
        "e.g. --slo ttft:500 itl:50",
    )
    p.add_argument(
        "--slo-search-steps", type=int, default=6, help="rates the SLO search measures (default 6)"
    )
    p.add_argument("--out", default="reports/bench.json", help="JSON results file")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(model: str, serve_flags: list[str], log: Path) -> Iterator[str]:
    """`python -m serve MODEL` in a process of its own (`evals.server_process`: forked warm) on a
    free port; yields its URL. The server is this process's own (loopback, a port nobody else
    was told): the API key a user exports for their servers ($WORKBENCH_API_KEY) is not passed
    on, or it would lock out our own requests."""
    from evals.server_process import start_server, stop_server
    from serve.http.cli import API_KEY_ENV

    port = _free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proc = start_server([model, "--port", str(port), *serve_flags], log, env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.exitcode is not None:
                raise RuntimeError(f"the server exited with {proc.exitcode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start in 10 minutes; see {log}")
            time.sleep(0.2)
        yield url
    finally:
        stop_server(proc)  # a graceful shutdown; killed if it takes more than a minute


def run_bench(args: argparse.Namespace, serve_flags: list[str]) -> LoadResult:
    if bool(args.url) == bool(args.model):
        raise SystemExit(
            "workbench bench: give a MODEL to serve or --url of a running server, not both"
        )
    out = Path(args.out)
    load = load_settings(args)

    def run(url: str) -> LoadResult:
        return sweep(url, load, model=args.request_model)

    if args.url:
        result = run(args.url)
    else:
        with served(args.model, serve_flags, out.with_suffix(".server.log")) as url:
            result = run(url)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.to_json(), indent=2))
    return result


def load_settings(args: argparse.Namespace) -> LoadEval:
    """The flags as the recipe's `load` settings; SystemExit naming the flag when one is out of
    range."""
    flags = {
        "max_tokens": "--max-tokens",
        "requests_per_point": "--requests",
        "requests_per_client": "--requests-per-client",
        "requests_per_rate_point": "--num-prompts",
        "slo_search_steps": "--slo-search-steps",
    }
    try:
        return LoadEval(
            concurrency=args.concurrency,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            requests_per_point=args.requests,
            requests_per_client=args.requests_per_client,
            request_rates=args.request_rate,
            requests_per_rate_point=args.num_prompts,
            slo=Slo(**dict(args.slo)) if args.slo else None,
            slo_search_steps=args.slo_search_steps,
        )
    except ValidationError as e:
        problems = "; ".join(
            f"{flags.get(str(err['loc'][0]), err['loc'][0]) if err['loc'] else 'flags'}: "
            f"{err['msg']}"
            for err in e.errors()
        )
        raise SystemExit(f"workbench bench: {problems}") from None


def print_summary(result: LoadResult) -> None:
    """The points as a table (open-loop points by their rate), then saturation and capacity."""
    print(
        f"{'load':>8} {'prompt':>6} {'req/s':>7} {'tok/s':>8} {'ttft p50':>9} {'ttft p95':>9} "
        f"{'itl p95':>8} {'e2e p95':>8} {'kv peak':>7} {'failed':>6}"
    )
    for p in result.every_point():
        load = f"{p.request_rate:g}/s" if p.request_rate else f"c={p.concurrency}"
        itl = p.itl.p95 if p.itl else float("nan")
        print(
            f"{load:>8} {p.prompt_len:>6} {p.request_throughput:>7.2f} "
            f"{p.output_throughput:>8.1f} {p.ttft.p50:>9.3f} {p.ttft.p95:>9.3f} "
            f"{itl:>8.4f} {p.e2e.p95:>8.3f} {p.peak_kv_usage:>7.2f} {p.failed:>6}"
        )
    for length, sat in result.saturation.items():
        estimate = sat.estimated_concurrency
        print(
            f"prompt {length}: saturation at concurrency {sat.measured_concurrency} "
            f"(estimate from KV budget: {'unknown' if estimate is None else f'{estimate:.1f}'})"
        )
    for length, cap in (result.capacity or {}).items():
        bounds = ", ".join(f"{k} <= {v:g}" for k, v in cap.slo.items())
        rate = "none met it" if cap.request_rate is None else f"{cap.request_rate:.3g} req/s"
        print(
            f"prompt {length}: within {bounds}: concurrency {cap.concurrency or 'none met it'}, "
            f"request rate {rate}"
        )


def failed_requests(result: LoadResult) -> int:
    """Requests that failed at any point of the run."""
    return sum(p.failed for p in result.every_point())

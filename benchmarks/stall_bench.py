"""Event-loop and step-loop stall benchmark: the longest gap between a normal stream's chunks
while a flood of hostile requests hits the same server, and the server's RSS before and after.

`python -m benchmarks.stall_bench [--model DIR] [--rounds 2] [--body KIND] [--flood N]`: serves
the model on 127.0.0.1 (uvicorn in a thread, as `workbench serve` does, so RSS is this process's),
streams greedy tokens (one 480-token stream after another while the flood lasts), starts the flood
after the first stream's 20th chunk, and prints per round the longest gap between chunks from
then on, the median gap, how the flood was answered, and RSS before, at its peak and after.

Floods (`--body`):
- `text`: one prompt of `--megabytes` (3) MB (tokenizing it on the event loop stalled streams);
- `prompts`: `{"prompt": [[5]] x 300,000, "n": 16}` (1.5 MB, issue 23);
- `mixed`: `--flood` (4) prompt lists `[1, "a" x 4 MiB]` (issue 67.3);
- `grammar`: `--flood` (2) requests constrained to 256 choices of 600 characters, each set
  distinct (issue 67.4);
- `schemas`: `--flood` (240) distinct JSON schemas of `--megabytes` MB each, mostly a long
  description (issue 67.5; 3 MB ones are refused by size since issue 67, so also try 0.2).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import socket
import statistics
import string
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import uvicorn

from catalog import ensure_demo_model
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.engine.async_engine import AsyncEngine
from serve.engine.llm_engine import LLMEngine
from serve.engine.metrics import ServerMetrics
from serve.http.server import ServerSettings, build_app

MiB = 1 << 20


def serve_in_thread(model: Path, max_model_len: int) -> tuple[str, uvicorn.Server]:
    engine = LLMEngine(
        ModelConfig(str(model), dtype="float32", device="cpu"),
        CacheConfig(num_blocks=1024, block_size=16),
        SchedulerConfig(max_model_len=max_model_len),
    )
    app = build_app(AsyncEngine(engine, ServerMetrics("m")), ServerSettings("m"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while not server.started:
        time.sleep(0.05)
    return url, server


def _choices(seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase, k=600)) for _ in range(256)]


def _schema(i: int, megabytes: float) -> dict:
    return {
        "type": "object",
        "description": "d" * int(megabytes * 1e6),
        "properties": {f"k{i}": {"enum": [f"v{i}-{j}" for j in range(50)]}},
        "required": [f"k{i}"],
    }


def flood_bodies(kind: str, megabytes: float, count: int | None, seed: int) -> Iterator[dict]:
    """The flood's request bodies, made one at a time (a 240 x 3 MB flood is not held)."""
    base = {"model": "m", "max_tokens": 4}
    if kind == "text":
        yield {**base, "prompt": "the quick brown fox jumps. " * int(megabytes * 1e6 / 27)}
    elif kind == "prompts":
        yield {"model": "m", "prompt": [[5]] * 300_000, "n": 16}
    elif kind == "mixed":
        for _ in range(count or 4):
            yield {**base, "prompt": [1, "a" * (4 * MiB - 200)]}
    elif kind == "grammar":
        for i in range(count or 2):
            yield {**base, "prompt": [11], "structured_outputs": {"choice": _choices(seed + i)}}
    else:
        for i in range(count or 240):
            schema = _schema(seed * 100_000 + i, megabytes)
            yield {**base, "prompt": [11], "structured_outputs": {"json": schema}}


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def one_round(url: str, bodies: Iterator[dict]) -> dict[str, float]:
    answered: dict[str, int] = {}
    peak = [rss()]
    before = peak[0]
    flooding = threading.Event()

    def flood() -> None:
        start = time.perf_counter()
        with httpx.Client(timeout=600) as client:
            for body in bodies:
                status = client.post(f"{url}/v1/completions", json=body).status_code
                answered[str(status)] = answered.get(str(status), 0) + 1
                peak[0] = max(peak[0], psutil.Process().memory_info().rss)
        answered["seconds"] = int(time.perf_counter() - start)
        flooding.clear()

    body = {"model": "m", "prompt": [11, 12], "max_tokens": 480, "ignore_eos": True}
    gaps: list[float] = []
    worker = threading.Thread(target=flood)
    while True:
        arrivals: list[float] = []
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=600
        ) as stream:
            for line in stream.iter_lines():
                if not line.startswith("data: "):
                    continue
                arrivals.append(time.perf_counter())
                if len(arrivals) == 20 and not worker.is_alive() and not answered:
                    flooding.set()
                    worker.start()
        skip = 20 if not gaps else 1
        gaps += [b - a for a, b in itertools.pairwise(arrivals[skip:])]
        if not flooding.is_set():
            break
    worker.join()
    after = rss()
    return {
        "max_gap_s": max(gaps),
        "median_gap_s": statistics.median(gaps),
        "rss_before": before,
        "rss_peak": max(peak[0], after),
        "rss_after": after,
        **{f"status_{k}": v for k, v in answered.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="model dir (default: the tiny demo model)")
    parser.add_argument("--megabytes", type=float, default=3.0)
    parser.add_argument("--flood", type=int, help="requests in the flood (default: per kind)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--body", choices=["text", "prompts", "mixed", "grammar", "schemas"], default="text"
    )
    args = parser.parse_args(argv)
    args.model = args.model or ensure_demo_model("demo-tiny")
    url, server = serve_in_thread(args.model, args.max_model_len)
    try:
        for i in range(args.rounds):
            bodies = flood_bodies(args.body, args.megabytes, args.flood, seed=i)
            r = one_round(url, bodies)
            statuses = ", ".join(
                f"{v} x {k[7:]}"
                for k, v in r.items()
                if k.startswith("status_") and k[7:].isdigit()
            )
            print(
                f"round {i + 1} ({args.body}): longest gap between chunks "
                f"{r['max_gap_s'] * 1000:.0f} ms (median {r['median_gap_s'] * 1000:.1f} ms); "
                f"flood answered {statuses} in {r.get('status_seconds', 0):.0f} s; RSS "
                f"{r['rss_before'] / 1e9:.2f} -> peak {r['rss_peak'] / 1e9:.2f} -> "
                f"{r['rss_after'] / 1e9:.2f} GB",
                flush=True,
            )
    finally:
        server.should_exit = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Event-loop stall benchmark: the longest gap between a stream's chunks while a huge prompt is
posted to the same server (issue: tokenizing a 3 MB prompt on the event loop stalled every
stream for seconds).

`python -m benchmarks.stall_bench [--model DIR] [--megabytes 3] [--rounds 2] [--body text|prompts]`:
serves the model on 127.0.0.1 (uvicorn in a thread, as `workbench serve` does), streams 480
greedy tokens, posts the big body after the 20th chunk, and prints per round the longest gap
between chunks from then on, the median gap, and how long the big request took to be answered.
`--body prompts` posts issue 23's case instead: `{"prompt": [[5]] x 300,000, "n": 16}` (1.5 MB).
"""

from __future__ import annotations

import argparse
import itertools
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from catalog import ensure_demo_model
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.engine.async_engine import AsyncEngine
from serve.engine.llm_engine import LLMEngine
from serve.engine.metrics import ServerMetrics
from serve.http.server import ServerSettings, build_app


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


def big_body(kind: str, megabytes: float) -> dict:
    if kind == "prompts":
        return {"model": "m", "prompt": [[5]] * 300_000, "n": 16}
    text = "the quick brown fox jumps. " * int(megabytes * 1e6 / 27)
    return {"model": "m", "prompt": text, "max_tokens": 4}


def one_round(url: str, big: dict) -> dict[str, float]:
    answered: dict[str, float] = {}

    def post_big() -> None:
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json=big, timeout=300)
        answered.update(seconds=time.perf_counter() - start, status=r.status_code)

    body = {"model": "m", "prompt": [11, 12], "max_tokens": 480, "ignore_eos": True}
    arrivals, worker = [], threading.Thread(target=post_big)
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300
    ) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            arrivals.append(time.perf_counter())
            if len(arrivals) == 20:
                worker.start()
    worker.join()
    gaps = [b - a for a, b in itertools.pairwise(arrivals[20:])]
    return {
        "max_gap_s": max(gaps),
        "median_gap_s": statistics.median(gaps),
        "big_prompt_s": answered["seconds"],
        "big_prompt_status": answered["status"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="model dir (default: the tiny demo model)")
    parser.add_argument("--megabytes", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--body", choices=["text", "prompts"], default="text")
    args = parser.parse_args(argv)
    args.model = args.model or ensure_demo_model("demo-tiny")
    url, server = serve_in_thread(args.model, args.max_model_len)
    try:
        big = big_body(args.body, args.megabytes)
        what = "300k-prompt body" if args.body == "prompts" else f"{args.megabytes:g} MB prompt"
        for i in range(args.rounds):
            r = one_round(url, big)
            print(
                f"round {i + 1}: longest gap between chunks {r['max_gap_s'] * 1000:.0f} ms "
                f"(median {r['median_gap_s'] * 1000:.1f} ms); the {what} "
                f"answered {r['big_prompt_status']:.0f} after {r['big_prompt_s']:.2f} s"
            )
    finally:
        server.should_exit = True
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

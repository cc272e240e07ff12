"""Serving speed of quantized variants against their base, in one process, alternating rounds.

`python -m evals.quant_bench DIR [DIR ...]` runs the same greedy workload (`--requests`
prompts of `--prompt-len` random tokens, `--max-tokens` outputs each, all submitted at once) on
the engine for every variant dir, round after round (A B C A B C), and prints output tokens/s
per variant with its median ratio to the first dir.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig


def tokens_per_second(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "dirs", nargs="+", type=Path, help="variant dirs; the first is the baseline"
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, 500) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    engines = {
        d.name: LLMEngine(
            ModelConfig(str(d), dtype="float32", device="cpu"),
            CacheConfig(num_blocks=1024),
            SchedulerConfig(max_num_seqs=args.requests),
        )
        for d in args.dirs
    }
    for engine in engines.values():
        tokens_per_second(engine, prompts[:2], 4)  # warm-up
    speeds: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            speeds[name].append(tokens_per_second(engine, prompts, args.max_tokens))
            print(f"round {r + 1} {name:>12}: {speeds[name][-1]:8.1f} output tok/s", flush=True)
    first = next(iter(speeds))
    print(
        f"threads={torch.get_num_threads()} requests={args.requests} prompt={args.prompt_len} out={args.max_tokens}"
    )
    for name, values in speeds.items():
        ratios = [v / b for v, b in zip(values, speeds[first])]
        print(
            f"{name:>12}: median {statistics.median(values):8.1f} tok/s, x{statistics.median(ratios):.2f} "
            f"of {first} (min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

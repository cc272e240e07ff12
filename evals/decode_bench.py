"""Decode step time of the engine at 1, 16 and 64 running sequences, with oneDNN-prepacked
linear layers (the default on the CPU) against plain `F.linear` (the baseline).

`python -m evals.decode_bench [--model DIR] [--rounds 3] [--context 128]`: for each batch size,
`n` requests of `context` prompt tokens are prefilled, then 32 decode steps are timed; the two
engines alternate round by round. Reports the median step time of each (min-max over rounds)
and the median of the per-round ratios. Default model: the ~25M random Llama of
`workbench bench-engine` (hidden 512, 8 layers, GQA 8/4).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from serve.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.engine import LLMEngine
from serve.sampling_params import SamplingParams

DECODE_STEPS = 32


def make_engine(model: Path, prepack: bool) -> LLMEngine:
    return LLMEngine(
        ModelConfig(str(model), dtype="float32", device="cpu", prepack_linears=prepack),
        CacheConfig(num_blocks=4096, block_size=8),
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192, enable_prefix_caching=False),
    )


def decode_step_seconds(engine: LLMEngine, n: int, context: int, tag: str) -> float:
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True)
    for i in range(n):
        prompt = [(i * 131 + j * 7919) % 4000 + 10 for j in range(context)]
        engine.add_request(f"{tag}-{i}", prompt, params)
    engine.step()  # prefill (all of it: the budget holds 64 x 128 tokens)
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    seconds = (time.perf_counter() - start) / DECODE_STEPS
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, help="model dir (default: the 25M random Llama)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args(argv)
    if args.model is None:
        from evals.engine_bench import default_llama_25m

        args.model = default_llama_25m()
    engines = {
        "prepacked": make_engine(args.model, True),
        "F.linear": make_engine(args.model, False),
    }
    with torch.inference_mode():
        for n in (1, 16, 64):
            times: dict[str, list[float]] = {name: [] for name in engines}
            for r in range(args.rounds + 1):
                for name, engine in engines.items():
                    seconds = decode_step_seconds(engine, n, args.context, f"{n}-{r}")
                    if r:  # round 0 warms up
                        times[name].append(seconds)
            ratios = [b / p for p, b in zip(times["prepacked"], times["F.linear"])]
            cells = ", ".join(
                f"{name} {statistics.median(v) * 1000:.1f} ms "
                f"({min(v) * 1000:.1f}-{max(v) * 1000:.1f})"
                for name, v in times.items()
            )
            print(
                f"{n:3d} sequences: decode step {cells}; F.linear / prepacked "
                f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

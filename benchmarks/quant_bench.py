"""Serving speed of quantized variants against their base, in one process, alternating rounds.

`python -m benchmarks.quant_bench DIR [DIR ...]` runs the same greedy workload (`--requests`
prompts of `--prompt-len` random tokens, `--max-tokens` outputs each, all submitted at once) on
the engine for every variant dir, round after round (A B C A B C), and prints output tokens/s
per variant with its median ratio to the first dir. `--kernels-at-every-size` also runs each
dir with torch's int4 / int8 CPU kernels at every call size (`NAME:kernels`; by default calls of
`compress.packed.dequantize_rows` rows or more are dequantized matmuls), the same engine
and weights, so the two are compared in one run. `--bitsandbytes-layers` also runs each dir with
bitsandbytes' own layers (`NAME:bitsandbytes`; by default the engine runs nf4 / fp4 / int8 layers
through its own kernels where bitsandbytes would convert the whole weight a call: `bnb_linear`).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from compress import packed
from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.model.bnb_linear import FourBitLinear, Int8Linear


def tokens_per_second(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[float, float]:
    """Output and total (prompt + output) tokens per second of one batch run to completion."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    out = len(prompts) * max_tokens
    return out / seconds, (out + sum(map(len, prompts))) / seconds


def _run(
    system: tuple[LLMEngine, bool], prompts: list[list[int]], max_tokens: int
) -> tuple[float, float]:
    engine, kernels_only = system
    kernels = mock.patch.object(packed, "dequantize_rows", lambda bits, x: sys.maxsize)
    with kernels if kernels_only else contextlib.nullcontext():
        return tokens_per_second(engine, prompts, max_tokens)


def load_engine(model: Path, requests: int, bitsandbytes_layers: bool = False) -> LLMEngine:
    """The engine on `model`; with `bitsandbytes_layers` its quantized layers stay bitsandbytes'."""
    keep = mock.patch("serve.engine.loader.replace_bnb_linears", return_value=0)
    with keep if bitsandbytes_layers else contextlib.nullcontext():
        return LLMEngine(
            ModelConfig(str(model), dtype="float32", device="cpu"),
            CacheConfig(num_blocks=1024),
            # every round prefills its prompts again: no KV reused across rounds
            SchedulerConfig(max_num_seqs=requests, enable_prefix_caching=False),
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "dirs", nargs="+", type=Path, help="variant dirs; the first is the baseline"
    )
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--kernels-at-every-size",
        action="store_true",
        help="also run each dir with the int4 / int8 CPU kernels at every call size",
    )
    parser.add_argument(
        "--bitsandbytes-layers",
        action="store_true",
        help="also run each dir whose bitsandbytes layers the engine replaces with bitsandbytes' own",
    )
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, 500) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    systems: dict[str, tuple[LLMEngine, bool]] = {}
    for d in args.dirs:
        engine = load_engine(d, args.requests)
        systems[d.name] = (engine, False)
        if args.kernels_at_every_size:
            systems[f"{d.name}:kernels"] = (engine, True)
        if args.bitsandbytes_layers and any(
            isinstance(m, (FourBitLinear, Int8Linear)) for m in engine.runner.model.modules()
        ):
            own = load_engine(d, args.requests, bitsandbytes_layers=True)
            systems[f"{d.name}:bitsandbytes"] = (own, False)
    for system in systems.values():
        _run(system, prompts[:2], 4)  # warm-up
    speeds: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
    for r in range(args.rounds):
        for name, system in systems.items():
            speeds[name].append(_run(system, prompts, args.max_tokens))
            out, total = speeds[name][-1]
            print(
                f"round {r + 1} {name:>20}: {out:8.1f} output, {total:8.1f} total tok/s", flush=True
            )
    print(
        f"threads={torch.get_num_threads()} requests={args.requests} prompt={args.prompt_len} out={args.max_tokens}"
    )
    first = next(iter(speeds))
    for name, values in speeds.items():
        ratios = [v[0] / b[0] for v, b in zip(values, speeds[first])]
        print(
            f"{name:>20}: median {statistics.median(v[0] for v in values):8.1f} output tok/s "
            f"({statistics.median(v[1] for v in values):.1f} total), x{statistics.median(ratios):.2f} "
            f"of {first} (min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Multi-LoRA serving cost, in one process: throughput over 0 / 1 / 4 / 16 distinct adapters,
adapter load latency, and inter-token latency during a burst of loads.

`python -m benchmarks.lora_bench [--model DIR|demo|llama-25m|smollm2] [--targets all|attention]`
(default: the demo model, all 7 linear layers of a block) makes 16 rank-16 PEFT adapters, then runs the same 64 greedy requests with their adapters spread
round-robin over 0 (base only), 1, 4 and 16 adapters, alternating round by round, on an engine
with 16 adapter slots. Loads are timed as the server does them: read and check off the engine
thread, register between two steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.lora.registry import LoraConfig

TARGETS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


def make_adapters(
    model_dir: Path, out: Path, count: int, rank: int, targets: list[str]
) -> list[Path]:
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(model_dir),
            PeftConfig(
                r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
            ),
        )
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.01)
        model.save_pretrained(str(out / f"a{i}"))
        paths.append(out / f"a{i}")
    return paths


def throughput(
    engine: LLMEngine, prompts: list[list[int]], versions: list[int | None], max_tokens: int
) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, (p, v) in enumerate(zip(prompts, versions)):
        engine.add_request(f"{time.monotonic_ns()}-{i}", p, params, adapter_id=v)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def step_times(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, burst: list[Path] | None
) -> list[float]:
    """Seconds per decode step of running requests; with `burst`, adapters are read on another
    thread meanwhile and each is registered between two steps as soon as it is read."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"itl-{time.monotonic_ns()}-{i}", p, params)
    engine.step()  # prefill
    ready: list = []
    reader = None
    registry, slots = engine.adapters, engine.runner.lora_slots
    assert registry is not None and slots is not None, "a LoRA engine"
    if burst:
        reader = threading.Thread(target=lambda: ready.extend(slots.read(p) for p in burst))
        reader.start()
    times, loaded = [], 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        while loaded < len(ready):
            registry.register(f"burst{loaded}", ready[loaded])
            loaded += 1
        engine.step()
        times.append(time.perf_counter() - start)
    if reader:
        reader.join()
    return times


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[94]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="demo", help="model dir, or demo, llama-25m, smollm2")
    parser.add_argument("--targets", default="all", choices=list(TARGETS), help="adapted layers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    from benchmarks.step_bench import resolve_model

    args.model = resolve_model(args.model)
    scratch = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    paths = make_adapters(args.model, scratch, 16, 16, TARGETS[args.targets])
    engine = LLMEngine(
        ModelConfig(str(args.model), dtype="float32", device="cpu"),
        CacheConfig(num_blocks=8192),
        SchedulerConfig(max_num_seqs=args.requests),
        lora=LoraConfig(max_loras=16, max_lora_rank=16, max_cpu_loras=64),
    )
    load_times = []
    versions = []
    for i, p in enumerate(paths):
        start = time.perf_counter()
        versions.append(engine.load_lora(f"a{i}", str(p)))
        load_times.append(time.perf_counter() - start)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(64)] for _ in range(args.requests)]
    spreads = {
        k: [None if k == 0 else versions[i % k] for i in range(args.requests)]
        for k in (0, 1, 4, 16)
    }
    throughput(engine, prompts[:4], spreads[16][:4], 4)  # warm-up
    speeds: dict[int, list[float]] = {k: [] for k in spreads}
    for r in range(args.rounds):
        for k, vs in spreads.items():
            speeds[k].append(throughput(engine, prompts, vs, args.max_tokens))
            print(f"round {r + 1}: {k:2d} adapters {speeds[k][-1]:8.1f} output tok/s", flush=True)
    for k in spreads:
        ratios = [v / b for v, b in zip(speeds[k], speeds[0])]
        print(
            f"{k:2d} adapters: median {statistics.median(speeds[k]):8.1f} tok/s, x{statistics.median(ratios):.2f} of base-only "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
    print(
        f"adapter load (rank 16, {len(TARGETS[args.targets])} modules per layer): p50 {statistics.median(load_times) * 1000:.1f} ms, "
        f"max {max(load_times) * 1000:.1f} ms"
    )
    quiet = step_times(engine, prompts[:32], args.max_tokens, None)
    busy = step_times(engine, prompts[:32], args.max_tokens, paths)
    print(
        f"inter-token latency at 32 running: p95 {p95(quiet) * 1000:.1f} ms without loads, "
        f"{p95(busy) * 1000:.1f} ms during a burst of 16 loads"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

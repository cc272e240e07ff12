"""Engine throughput against transformers' own batching, in one process, on the same requests.

Systems: this engine (`LLMEngine`); `generate` with static padded batches (every batch runs until
its longest request is done); transformers' continuous batching (`init_continuous_batching`);
with `--vllm-venv`, vLLM's offline engine in its own venv (`benchmarks/vllm_system.py`, default
flags, prefix caching off as in ours). Every system generates exactly each request's `max_tokens`
(end-of-sequence ignored), so the useful output is the same and throughput = requested output
tokens / wall seconds. Rounds run the systems in alternation (A B C A B C) and ratios are taken
per round: the median, min and max are reported, as the shared 2-core machines drift.

Workloads: `benchmarks/workloads.py` (`mixed`, `equal`, and the engine issue's `mixed-256`,
`uniform`, `prefill-bound`, `decode-bound`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from benchmarks.bench_models import DEFAULT_BLOCK_SIZE, load_baseline_model
from benchmarks.vllm_system import VllmWorker, agreement
from benchmarks.workloads import Workload, make_workload
from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from workbench.model_shape import parameter_count


@dataclass
class Measured:
    seconds: float
    extra: dict[str, float] = field(default_factory=dict)
    outputs: list[list[int]] | None = None
    """Each request's output token ids, where the system returns them."""


def run_engine(engine: LLMEngine, w: Workload) -> Measured:
    for i, (prompt, n) in enumerate(zip(w.prompts, w.max_tokens)):
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        )
    engine.timings.clear()
    wastes, peak_running, steps = [], 0, 0
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        stats = engine.stats()
        steps += 1
        peak_running = max(peak_running, stats.num_running)
        if stats.num_running >= 32:
            wastes.append(stats.kv_waste)
    seconds = time.perf_counter() - start
    step_total = sum(engine.timings.values())
    extra = {f"share_{k}": v / step_total for k, v in engine.timings.items()}
    extra.update(
        steps=steps,
        peak_running=peak_running,
        kv_waste_mean=statistics.fmean(wastes or [0.0]),
        kv_waste_max=max(wastes or [0.0]),
        preemptions=engine.stats().num_preemptions,
    )
    return Measured(seconds, extra, [outputs[str(i)] for i in range(len(w.prompts))])


def run_vllm(worker: VllmWorker, w: Workload) -> Measured:
    result = worker.generate(w.prompts, w.max_tokens)
    assert [len(o) for o in result.outputs] == w.max_tokens, "vLLM stopped a request early"
    return Measured(result.seconds, outputs=result.outputs)


def run_static(model: PreTrainedModel, w: Workload, batch_size: int, pad_id: int) -> Measured:
    start = time.perf_counter()
    for i in range(0, len(w.prompts), batch_size):
        prompts = w.prompts[i : i + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        longest = max(w.max_tokens[i : i + batch_size])
        config = GenerationConfig(
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=None,
        )
        with torch.inference_mode():
            generate: Any = model.generate  # typed by transformers as a tensor attribute
            out = generate(ids, attention_mask=mask, generation_config=config)
        assert out.shape[1] == width + longest
    return Measured(time.perf_counter() - start)


def run_hf_continuous(model: PreTrainedModel, w: Workload) -> Measured:
    config = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=max(w.max_tokens))
    batching: Any = model.init_continuous_batching  # typed by transformers as a tensor
    manager = batching(generation_config=config)
    manager.start()
    try:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(w.prompts, w.max_tokens)):
            manager.add_request(prompt, request_id=str(i), max_new_tokens=n, eos_token_id=-1)
        done = 0
        while done < len(w.prompts):
            result = manager.get_result(timeout=5)
            if result is not None and result.is_finished():
                assert len(result.generated_tokens) == w.max_tokens[int(result.request_id)]
                done += 1
        return Measured(time.perf_counter() - start)
    finally:
        manager.stop(block=True)


@dataclass
class SystemRuns:
    name: str
    run: Callable[[], Measured]
    results: list[Measured] = field(default_factory=list)


def compare(
    systems: list[SystemRuns], rounds: int, tokens: int, log: Callable[[str], None]
) -> None:
    for r in range(rounds):
        for s in systems:
            s.results.append(s.run())
            log(f"round {r + 1} {s.name:>16}: {tokens / s.results[-1].seconds:8.1f} tok/s")


def ratio_summary(ours: SystemRuns, other: SystemRuns) -> tuple[float, float, float]:
    ratios = [o.seconds / m.seconds for m, o in zip(ours.results, other.results)]
    return statistics.median(ratios), min(ratios), max(ratios)


def engine_for(
    model_dir: Path,
    kv_bytes: int,
    max_num_seqs: int = 256,
    block_size: int = DEFAULT_BLOCK_SIZE,
    batched: int = 1024,
    compile_model: bool = False,
) -> LLMEngine:
    return LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cpu", compile=compile_model),
        CacheConfig(block_size=block_size, kv_cache_bytes=kv_bytes),
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=2048,
            enable_prefix_caching=False,  # rounds repeat the same prompts
        ),
    )


def concurrency_vs_contiguous(
    model_dir: Path, vocab: int, max_model_len: int = 2048, block_size: int = DEFAULT_BLOCK_SIZE
) -> dict[str, float]:
    """At a KV budget that holds 16 contiguous `max_model_len` reservations, how many sequences
    run at once with paged blocks (256 requests of the mixed workload, all submitted at once)."""
    probe = engine_for(model_dir, 1 << 20)
    budget = 16 * max_model_len * probe.runner.layout.bytes_per_token()
    engine = engine_for(model_dir, budget, max_num_seqs=1024, block_size=block_size)
    w = make_workload("mixed", 256, vocab, seed=1)
    measured = run_engine(engine, w)
    contiguous = budget // (max_model_len * engine.runner.layout.bytes_per_token())
    return {
        "kv_budget_bytes": budget,
        "contiguous_sequences": contiguous,
        "paged_peak_sequences": measured.extra["peak_running"],
        "ratio": measured.extra["peak_running"] / contiguous,
    }


def bench_model(
    name: str,
    model_dir: Path,
    workloads: list[str],
    rounds: int,
    n: int,
    log: Callable[[str], None],
    block_size: int = DEFAULT_BLOCK_SIZE,
    vllm: VllmWorker | None = None,
    max_num_batched_tokens: int = 1024,
    hf_baselines: bool = True,
    compile_model: bool = False,
) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = engine_for(
        model_dir,
        3 << 30,
        block_size=block_size,
        batched=max_num_batched_tokens,
        compile_model=compile_model,
    )
    report: dict = {"model": name, "parameters": parameter_count("model", model_dir)}
    warm = make_workload("mixed", 4, len(tok), seed=99)
    run_engine(engine, warm)
    baseline = load_baseline_model(model_dir) if hf_baselines else None
    if baseline is not None:
        run_static(baseline, warm, 4, tok.pad_token_id)
        run_hf_continuous(baseline, warm)
    if vllm is not None:
        run_vllm(vllm, warm)
        report["vllm"] = {"version": vllm.version, "config": vllm.config}
    for kind in workloads:
        w = make_workload(kind, n, len(tok))
        systems = [SystemRuns("engine", functools.partial(run_engine, engine, w))]
        if baseline is not None:
            systems += hf_systems(baseline, w, tok.pad_token_id)
        if vllm is not None:
            systems.append(SystemRuns("vllm", functools.partial(run_vllm, vllm, w)))
        log(f"== {name}, workload {kind}: {n} requests, {w.counted_tokens} counted tokens")
        compare(systems, rounds, w.counted_tokens, log)
        report[kind] = summarize(systems, w, log)
    return report


def hf_systems(baseline: PreTrainedModel, w: Workload, pad: int) -> list[SystemRuns]:
    return [
        SystemRuns("static-16", functools.partial(run_static, baseline, w, 16, pad)),
        SystemRuns("static-64", functools.partial(run_static, baseline, w, 64, pad)),
        SystemRuns("hf-continuous", functools.partial(run_hf_continuous, baseline, w)),
    ]


def summarize(systems: list[SystemRuns], w: Workload, log: Callable[[str], None]) -> dict:
    """Tokens per second of each system (medians), and the engine's per-round ratios to the
    best static batch, to transformers' continuous batching and to vLLM when it ran."""
    by_name = {s.name: s for s in systems}
    ours = by_name["engine"]
    summary: dict[str, Any] = {
        "tokens_per_s": {
            s.name: w.counted_tokens / statistics.median(m.seconds for m in s.results)
            for s in systems
        },
        "engine": ours.results[-1].extra,
    }
    if "static-16" in by_name:
        best_static = min(
            (by_name["static-16"], by_name["static-64"]),
            key=lambda s: statistics.median(m.seconds for m in s.results),
        )
        summary["best_static"] = best_static.name
        summary["vs_best_static"] = ratio_summary(ours, best_static)
        summary["vs_hf_continuous"] = ratio_summary(ours, by_name["hf-continuous"])
        log(f"   engine / {best_static.name} (median, min, max): {summary['vs_best_static']}")
        log(f"   engine / hf-continuous (median, min, max): {summary['vs_hf_continuous']}")
    if "vllm" in by_name:
        theirs = by_name["vllm"]
        summary["vs_vllm"] = ratio_summary(ours, theirs)
        mine, vllms = ours.results[-1].outputs, theirs.results[-1].outputs
        assert mine is not None and vllms is not None
        summary["same_outputs_as_vllm"] = agreement(mine, vllms)
        log(
            f"   engine / vllm (median, min, max): {summary['vs_vllm']}; requests with the"
            f" same output tokens: {summary['same_outputs_as_vllm']:.0%}"
        )
    return summary


def step_times(
    model_dir: Path, rounds: int, log: Callable[[str], None], vllm_venv: Path | None = None
) -> dict:
    """Median ms of a decode step at 1/16/64 sequences and of a 1,024-token prefill, engine,
    `generate` (and vLLM) side by side (`benchmarks.step_bench`)."""
    from benchmarks.step_bench import measure

    systems = ["engine", "generate", *(["vllm"] if vllm_venv else [])]
    cells = measure(model_dir, systems, rounds, 128, 1024, log, vllm_venv=vllm_venv)
    return {c.name: {s: statistics.median(v) * 1000 for s, v in c.times.items()} for c in cells}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench bench-engine", description=__doc__)
    parser.add_argument(
        "--models", default="demo,llama-25m,smollm2", help="comma list: demo, llama-25m, smollm2"
    )
    parser.add_argument(
        "--workloads",
        default="mixed,equal",
        help="comma list: mixed, equal, mixed-256, uniform, prefill-bound, decode-bound",
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per workload")
    parser.add_argument("--requests", type=int, default=64, help="requests per workload")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    parser.add_argument("--out", default="reports/bench-engine.json", help="JSON results file")
    parser.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="KV block size of the engine"
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=1024, help="the engine's step budget"
    )
    parser.add_argument(
        "--vllm-venv",
        type=Path,
        help="a venv with vllm(-cpu): vLLM's offline engine joins as a system (default flags)",
    )
    parser.add_argument("--skip-steps", action="store_true", help="no per-step times")
    parser.add_argument(
        "--vllm-eager", action="store_true", help="vLLM with --enforce-eager (no torch.compile)"
    )
    parser.add_argument("--compile", action="store_true", help="the engine with --compile")
    parser.add_argument(
        "--no-hf-baselines",
        action="store_true",
        help="leave out transformers' static and continuous batching (engine and vLLM only)",
    )
    parser.add_argument(
        "--concurrency-models",
        default="demo,llama-25m",
        help="models whose paged-vs-contiguous concurrency is measured (256 requests each)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    from benchmarks.step_bench import resolve_model
    from serve.model.host_memory import keep_freed_memory

    args = build_parser().parse_args(argv)
    keep_freed_memory()  # before any system runs: the baselines get it too
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "models": []}
    for name in args.models.split(","):
        model_dir = resolve_model(name)
        with contextlib.ExitStack() as stack:
            vllm = None
            if args.vllm_venv:
                log = Path(args.out).with_suffix(f".vllm-{name}.log")
                print(f"starting vLLM on {model_dir} (its log: {log})")
                worker = VllmWorker(args.vllm_venv, model_dir, log, enforce_eager=args.vllm_eager)
                vllm = stack.enter_context(worker)
            report = bench_model(
                name,
                model_dir,
                [w for w in args.workloads.split(",") if w],
                args.rounds,
                args.requests,
                print,
                args.block_size,
                vllm,
                args.max_num_batched_tokens,
                not args.no_hf_baselines,
                args.compile,
            )
        if not args.skip_steps:
            print(f"== {name}: per-step times (median of {args.rounds} rounds)")
            report["steps_ms"] = step_times(model_dir, args.rounds, print, args.vllm_venv)
        if name in args.concurrency_models.split(","):
            report["concurrency"] = concurrency_vs_contiguous(
                model_dir, 4096, block_size=args.block_size
            )
            print("   concurrency at a fixed KV budget:", report["concurrency"])
        results["models"].append(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a step's time goes, this engine beside vLLM: the same requests under each one's torch
profiler, operator self-times summed into families (linears, attention, KV writes and gathers,
elementwise, sampling, other operators) and the rest of the wall time (Python, scheduling,
waiting) as `outside operators`.

`python -m benchmarks.op_profile --vllm-venv .vllm-venv [--model llama-25m]
[--workloads decode-64,prefill-bound] [--compile] [--out reports/op-profile.json]`
(`--compile`: this engine through `torch.compile`, as vLLM runs by default; inductor's C++
kernels then appear as operators named after what they fuse.)

- `decode-N`: N prompts of 128 tokens, 33 output tokens each (one prefill step, 32 decodes).
- any workload of `bench-engine` (`mixed-256`, `prefill-bound`, ...), 64 requests.

Both systems run once unprofiled first (vLLM compiles, caches warm). Traces are Chrome JSON;
self time = an event's duration less its children's on the same thread. The engine's decode
and prefill attention kernels (ctypes calls, not torch operators) are timed through a
`record_function` around each, so they count as attention, not as time outside operators.
vLLM's trace covers its worker process (where the model runs); its frontend's time is in its
wall time only. NOTE: under the profiler this engine's 1,024-row oneDNN products took 20.7 ms a
call against 12.6 ms timed by hand in the same engine, so its linears row overstates them;
compare linears unprofiled (`step_bench`, `bench-engine`). Under each
family the output lists its largest operators per system (`TOP`; also in the JSON), so a family's
gap can be traced to the operators behind it. Linears, most of a step on the CPU, are also split
by product shape, rows x in -> out features (`linears_by_rows`: both traces record shapes): a
decode step's products have one row per running sequence, a prefill chunk's one per token, so
the table compares the two systems per step kind and shows whether a gap is the product's own
time or its number of calls.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_bench import engine_for, run_engine
from benchmarks.step_bench import resolve_model
from benchmarks.vllm_system import VllmWorker
from benchmarks.workloads import Workload, make_workload
from serve import LLMEngine

FAMILIES: list[tuple[str, tuple[str, ...]]] = [
    ("kv write / gather", ("index", "reshape_and_cache", "scatter", "gather", "kv_cache_update")),
    ("attention", ("attention", "attn", "sdpa", "flash", "paged")),
    ("linears", ("linear", "mm", "matmul", "gemm")),
    ("sampling", ("argmax", "topk", "sample", "softmax", "sort")),
    (
        "elementwise",
        (
            "mul",
            "add",
            "silu",
            "pow",
            "mean",
            "rsqrt",
            "neg",
            "cat",
            "div",
            "sum",
            "norm",
            "rotary",
            "act_and",
            "sub",
            "exp",
            "copy",
            "to",
            "fill",
            "where",
            "clamp",
        ),
    ),
]


def family(name: str) -> str:
    low = name.lower()
    for label, needles in FAMILIES:
        if any(n in low for n in needles):
            return label
    return "other operators"


def self_times(events: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Operator self time (microseconds) per name, from complete events of CPU operators."""
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        # user annotations: only ours around the kernel (vLLM's wrap whole steps)
        if e.get("cat") == "cpu_op" or (
            e.get("cat") == "user_annotation" and e.get("name") in KERNEL_EVENTS.values()
        ):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    totals: dict[str, float] = defaultdict(float)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list[Any]] = []  # [end, name, children's time]
        for e in thread:
            while stack and stack[-1][0] <= e["ts"]:
                _, name, children = stack.pop()
                totals[name] -= children
            if stack:
                stack[-1][2] += e["dur"]
            totals[e["name"]] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], 0.0])
        for _, name, children in stack:
            totals[name] -= children
    return dict(totals)


def by_family(times: dict[str, float], wall_us: float) -> dict[str, float]:
    """Milliseconds per family, `outside operators` = wall - all operators."""
    out: dict[str, float] = defaultdict(float)
    for name, us in times.items():
        out[family(name)] += us / 1000
    out["outside operators"] = wall_us / 1000 - sum(out.values())
    return dict(out)


def top_operators(times: dict[str, float], n: int) -> dict[str, list[tuple[str, float]]]:
    """Per family, its `n` operators with the most self time: (name, ms), largest first."""
    ranked: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for name, us in sorted(times.items(), key=lambda item: -item[1]):
        if len(ranked[family(name)]) < n:
            ranked[family(name)].append((name, us / 1000))
    return dict(ranked)


def product_shape(name: str, dims: list[list[int]]) -> tuple[int, int, int] | None:
    """(rows, in features, out features) of a linear operator's call from its recorded input
    dims, in each operator's own argument order; None where they were not recorded."""
    if name == "_C::onednn_mm":  # vLLM's (output, input, bias, handler)
        out, x = [*dims, [], []][:2]
        if len(out) < 2 or not x:
            return None
        return math.prod(out[:-1]), x[-1], out[-1]
    if name in ("aten::mm", "aten::addmm"):  # ([bias,] input, weight [in, out][, beta, alpha])
        x, w = [*dims, [], [], []][name == "aten::addmm" :][:2]
        return (x[0], x[-1], w[-1]) if len(x) == 2 and len(w) == 2 else None
    x, w = [*dims, [], []][:2]  # (input, weight [out, in], ...): linear, _linear_pointwise
    return (math.prod(x[:-1]), x[-1], w[0]) if x and len(w) == 2 else None


def linears_by_rows(events: Iterable[dict[str, Any]]) -> dict[str, tuple[int, float]]:
    """Linear operators' calls and milliseconds per product shape, "rows x in -> out" (rows: the
    input's leading dims multiplied), from complete CPU-op events that recorded their shapes."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "cpu_op" or family(e["name"]) != "linears":
            continue
        shape = product_shape(e["name"], (e.get("args") or {}).get("Input Dims") or [])
        if shape is None:
            continue  # a wrapper (aten::matmul) or a call whose shapes went unrecorded
        entry = out["{} x {} -> {}".format(*shape)]
        entry[0] += 1
        entry[1] += e["dur"] / 1000
    return {key: (int(n), ms) for key, (n, ms) in out.items()}


Profile = tuple[
    float, dict[str, float], dict[str, list[tuple[str, float]]], dict[str, tuple[int, float]]
]
"""(wall seconds, ms per family, each family's largest operators, linears by input shape)."""

TOP = 4
"""Operators listed per family."""


def _profile(events: list[dict[str, Any]], wall_s: float) -> Profile:
    times = self_times(events)
    return (
        wall_s,
        by_family(times, wall_s * 1e6),
        top_operators(times, TOP),
        linears_by_rows(events),
    )


def trace_events(paths: Iterable[Path]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in paths:
        events += json.loads(path.read_text()).get("traceEvents", [])
    return events


def workload(kind: str, vocab: int) -> Workload:
    if kind.startswith("decode-"):
        n = int(kind.split("-")[1])
        w = make_workload("uniform", n, vocab, seed=5)
        return Workload(kind, w.prompts, [33] * n)
    return make_workload(kind, 64, vocab)


KERNEL_EVENTS = {
    "attend_decodes": "workbench::paged_decode_attention",
    "attend_prefills": "workbench::paged_prefill_attention",
}
"""The engine's CPU attention kernels are ctypes calls, invisible to the profiler; the profiled
engine's backend runs each method inside a `record_function` of its name here."""


def traced_attention_kernels(engine: LLMEngine) -> None:
    backend: Any = engine.runner.backend  # the protocol names `attend`; backends have these

    def traced(method: str) -> Callable[..., Any]:
        attend: Callable[..., Any] = getattr(backend, method)

        def call(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(KERNEL_EVENTS[method]):
                return attend(*args, **kwargs)

        return call

    for method in KERNEL_EVENTS:
        setattr(backend, method, traced(method))  # on this one instance


def profile_engine(model: Path, w: Workload, compile_model: bool = False) -> Profile:
    if compile_model:  # each of inductor's C++ kernels a profiler event, named by what it fuses
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    engine = engine_for(model, 1 << 30, compile_model=compile_model)
    traced_attention_kernels(engine)
    run_engine(engine, w)  # warm
    trace = Path(tempfile.mkdtemp()) / "engine.json"
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        start = time.perf_counter()
        run_engine(engine, w)
        wall = time.perf_counter() - start
    prof.export_chrome_trace(str(trace))
    return _profile(trace_events([trace]), wall)


def profile_vllm(worker: VllmWorker, w: Workload) -> Profile:
    assert worker.profile_dir is not None
    worker.generate(w.prompts, w.max_tokens)  # warm
    before = set(worker.profile_dir.rglob("*.json"))
    result = worker.generate(w.prompts, w.max_tokens, profile=True)
    for _ in range(60):  # the worker writes its trace after stop_profile returns
        traces = [p for p in worker.profile_dir.rglob("*.json") if p not in before]
        if traces:
            break
        time.sleep(1)
    time.sleep(2)
    workers = [p for p in traces if "rank" in p.name or "worker" in p.name.lower()] or traces
    return _profile(trace_events(workers), result.seconds)


def print_linears_by_rows(
    ours: dict[str, tuple[int, float]], theirs: dict[str, tuple[int, float]]
) -> None:
    """Side by side, largest first: calls, total and per-call milliseconds per input shape."""
    print("   linears by shape (rows x in -> out):   engine calls / ms / per call     vllm")
    shapes = sorted(
        set(ours) | set(theirs),
        key=lambda k: -max(ours.get(k, (0, 0.0))[1], theirs.get(k, (0, 0.0))[1]),
    )
    for shape in shapes:
        cells = []
        for n, ms in (ours.get(shape, (0, 0.0)), theirs.get(shape, (0, 0.0))):
            cells.append(f"{n:5d} {ms:9.1f} {ms / n if n else 0.0:8.3f}")
        print(f"   {shape:>24}:   {cells[0]}   {cells[1]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-25m")
    parser.add_argument("--workloads", default="decode-64,prefill-bound")
    parser.add_argument("--vllm-venv", type=Path, required=True)
    parser.add_argument("--out", default="reports/op-profile.json")
    parser.add_argument(
        "--compile", action="store_true", help="this engine through torch.compile, as vLLM runs"
    )
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    results: dict[str, Any] = {"model": args.model}
    profile_dir = Path(tempfile.mkdtemp(prefix="vllm-profile-"))
    log = profile_dir / "worker.log"
    with VllmWorker(args.vllm_venv, model, log, profile_dir=profile_dir) as worker:
        for kind in args.workloads.split(","):
            w = workload(kind, vocab)
            ours = profile_engine(model, w, args.compile)
            theirs = profile_vllm(worker, w)
            results[kind] = {"engine": ours, "vllm": theirs}
            print(f"== {kind}: wall engine {ours[0] * 1000:.0f} ms, vllm {theirs[0] * 1000:.0f} ms")
            names = sorted(set(ours[1]) | set(theirs[1]), key=lambda n: -ours[1].get(n, 0))
            for name in names:
                a, b = ours[1].get(name, 0.0), theirs[1].get(name, 0.0)
                print(f"   {name:>20}: engine {a:8.1f} ms   vllm {b:8.1f} ms")
                for system, (_, _, top, _) in (("engine", ours), ("vllm", theirs)):
                    for op, ms in top.get(name, []):
                        print(f"   {'':>20}    {system:>6} {ms:8.1f} ms  {op[:90]}")
            print_linears_by_rows(ours[3], theirs[3])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out} (vLLM traces in {profile_dir})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

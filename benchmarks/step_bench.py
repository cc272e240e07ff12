"""Per-step times of the engine's configurations and of transformers' `generate`, side by side:
a decode step at 1, 16 and 64 running sequences, and the prefill of 1,024 prompt tokens.

`python -m benchmarks.step_bench [--model DIR|demo|llama-25m|smollm2] [--systems engine,sdpa,generate]
[--rounds 3] [--context 128] [--device cpu|cuda] [--phases]`

Engine systems: engine (defaults), engine-bf16, engine-compile, engine-bf16-compile, engine-unmerged
and engine-compile-unmerged (q/k/v and gate/up as separate products), engine-unfused
(transformers' decoder layers, not `serve/model/fused_layers.py`'s), engine-block8 and
engine-block32 (KV blocks of 8 / 32 tokens instead of the default 16; every system's cache
holds 65,536 tokens), engine-sdpa-prefill and engine-bf16-sdpa-prefill (prefill chunks through
SDPA, not the paged prefill kernel) (`--compile`: graphs built when the system is set up, not
timed), sdpa (the gather backend), sdpa-flinear (also without prepacked linears). Baselines:
generate, generate-bf16, and vllm (`--vllm-venv`: vLLM's offline engine in its own venv, default
flags, prefix caching off).

- engine systems: `n` requests of `context` prompt tokens are prefilled, then 32 decode steps are
  timed (`engine.step()`, all of it: schedule, inputs, forward, sample, update). Prefill: one
  prompt of `--prefill` tokens and one output token, whole in one step (no prefix cache).
- `generate` (transformers, SDPA attention, its dynamic KV cache): a static batch of `n` prompts
  of `context` tokens; a decode step is (time for 33 new tokens - time for 1) / 32. Prefill: one
  `generate` call with one new token on a `--prefill`-token prompt.
- `vllm`: the same as `generate`, each figure from whole `LLM.generate` calls timed in its worker
  (its scheduling and sampling included, as in the engine's steps).
Systems run in alternation round by round (the first round warms up and is not counted); each
cell is the median with min-max, and ratios are per round against the first system.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from benchmarks.bench_models import DEFAULT_BLOCK_SIZE, default_llama_25m, load_baseline_model
from benchmarks.vllm_system import VllmWorker
from serve.core.config import AttentionBackend, CacheConfig, Dtype, ModelConfig, SchedulerConfig
from serve.core.sampling_params import SamplingParams
from serve.engine.llm_engine import LLMEngine
from serve.model.cpu_attention import PagedCPUBackend
from serve.model.host_memory import keep_freed_memory

DECODE_STEPS = 32
KV_TOKENS = 65536
"""The KV cache of every engine system, whatever its block size."""
BATCHES = (1, 16, 64)


@dataclass(frozen=True)
class EngineSystem:
    backend: AttentionBackend = "auto"
    prepack: bool = True
    dtype: Dtype = "float32"
    compile: bool = False
    merge: bool = True
    fuse: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    prefill_kernel: bool = True
    """False: the paged-cpu backend's prefill chunks go to SDPA (its decode kernel stays)."""


ENGINE_SYSTEMS = {
    "engine": EngineSystem(),
    "engine-bf16": EngineSystem(dtype="bfloat16"),
    "engine-compile": EngineSystem(compile=True),
    "engine-unmerged": EngineSystem(merge=False),
    "engine-unfused": EngineSystem(fuse=False),
    "engine-block8": EngineSystem(block_size=8),
    "engine-block32": EngineSystem(block_size=32),
    "engine-compile-unmerged": EngineSystem(compile=True, merge=False),
    "engine-bf16-compile": EngineSystem(dtype="bfloat16", compile=True),
    "engine-sdpa-prefill": EngineSystem(prefill_kernel=False),
    "engine-bf16-sdpa-prefill": EngineSystem(dtype="bfloat16", prefill_kernel=False),
    "sdpa": EngineSystem(backend="sdpa"),
    "sdpa-flinear": EngineSystem(backend="sdpa", prepack=False),
}
GENERATE_SYSTEMS = {"generate": torch.float32, "generate-bf16": torch.bfloat16}


def prompt_ids(i: int, length: int, vocab: int) -> list[int]:
    return [(i * 131 + j * 7919) % (vocab - 10) + 10 for j in range(length)]


def make_engine(
    model: Path, system: EngineSystem, prefill: int, context: int, device: str = "cpu"
) -> LLMEngine:
    """An engine whose step budget holds the largest batch's whole prefill, so the timed steps
    are decode steps only."""
    return LLMEngine(
        ModelConfig(
            str(model),
            dtype=system.dtype,
            device=device,
            attention_backend=system.backend,
            prepack_linears=system.prepack,
            merge_projections=system.merge,
            fuse_layers=system.fuse,
            compile=system.compile,
        ),
        CacheConfig(num_blocks=KV_TOKENS // system.block_size, block_size=system.block_size),
        SchedulerConfig(
            max_num_seqs=max(BATCHES),
            max_num_batched_tokens=max(8192, prefill, max(BATCHES) * context),
            enable_prefix_caching=False,
        ),
    )


Phases = dict[int, dict[str, float]]
"""Decode batch size -> the engine's step phases (`LLMEngine.timings`: schedule, model, sample,
update), seconds per step in the latest timed run. On CUDA `model` is the launches and `sample`
waits for the GPU (its host copy of the tokens)."""


def engine_decode_step(
    engine: LLMEngine, n: int, context: int, tag: str, phases: Phases | None = None
) -> float:
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"{tag}-{i}", prompt_ids(i, context, engine.vocab_size), params)
    engine.step()  # the whole prefill: the budget holds it (`make_engine`)
    before = dict(engine.timings)
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    seconds = (time.perf_counter() - start) / DECODE_STEPS
    if phases is not None:
        phases[n] = {k: (v - before.get(k, 0.0)) / DECODE_STEPS for k, v in engine.timings.items()}
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


def engine_prefill(engine: LLMEngine, tokens: int, tag: str) -> float:
    engine.add_request(
        tag, prompt_ids(7, tokens, engine.vocab_size), SamplingParams(max_tokens=1, temperature=0)
    )
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _generate(model: PreTrainedModel, ids: torch.Tensor, new: int) -> float:
    config = GenerationConfig(
        max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    ids = ids.to(model.device)
    _synchronize(model.device)
    start = time.perf_counter()
    generate: Any = model.generate  # typed by transformers as a tensor attribute
    generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    _synchronize(model.device)
    return time.perf_counter() - start


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate_decode_step(model: PreTrainedModel, n: int, context: int) -> float:
    vocab = model.get_output_embeddings().out_features
    ids = torch.tensor([prompt_ids(i, context, vocab) for i in range(n)])
    return (_generate(model, ids, DECODE_STEPS + 1) - _generate(model, ids, 1)) / DECODE_STEPS


def generate_prefill(model: PreTrainedModel, tokens: int) -> float:
    vocab = model.get_output_embeddings().out_features
    return _generate(model, torch.tensor([prompt_ids(7, tokens, vocab)]), 1)


Runs = tuple[Callable[[int, str], float], Callable[[str], float]]
"""A system's (decode step at n sequences, prefill) measurements, each given a request tag."""


def vllm_runs(worker: VllmWorker, vocab: int, context: int, prefill: int) -> Runs:
    def decode(n: int, tag: str) -> float:
        prompts = [prompt_ids(i, context, vocab) for i in range(n)]
        full = worker.generate(prompts, [DECODE_STEPS + 1] * n).seconds
        return (full - worker.generate(prompts, [1] * n).seconds) / DECODE_STEPS

    def fill(tag: str) -> float:
        return worker.generate([prompt_ids(7, prefill, vocab)], [1]).seconds

    return decode, fill


def engine_runs(
    engine: LLMEngine, context: int, prefill: int, phases: Phases | None = None
) -> Runs:
    def decode(n: int, tag: str) -> float:
        return engine_decode_step(engine, n, context, tag, phases)

    def fill(tag: str) -> float:
        return engine_prefill(engine, prefill, tag)

    return decode, fill


def generate_runs(model: PreTrainedModel, context: int, prefill: int) -> Runs:
    def decode(n: int, tag: str) -> float:
        return generate_decode_step(model, n, context)

    def fill(tag: str) -> float:
        return generate_prefill(model, prefill)

    return decode, fill


@dataclass
class Cell:
    """One measurement kind (decode at n, or prefill) of every system, round by round."""

    name: str
    runs: dict[str, Callable[[str], float]]
    times: dict[str, list[float]] = field(init=False)

    def __post_init__(self) -> None:
        self.times = {system: [] for system in self.runs}

    def line(self) -> str:
        first = next(iter(self.times))
        parts = []
        for system, values in self.times.items():
            cell = f"{system} {ms(statistics.median(values))} ({ms(min(values))}-{ms(max(values))})"
            if system != first:
                ratios = [o / f for f, o in zip(self.times[first], values)]
                cell += f" = x{statistics.median(ratios):.2f} of {first}"
            parts.append(cell)
        return f"{self.name}: " + "; ".join(parts)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def measure(
    model: Path,
    systems: list[str],
    rounds: int,
    context: int,
    prefill: int,
    log: Callable[[str], None] = print,
    device: str = "cpu",
    vllm_venv: Path | None = None,
    show_phases: bool = False,
) -> list[Cell]:
    """Every system's decode step at 1/16/64 sequences and its prefill, alternating per round
    (engine steps end in a host copy of the sampled tokens, so CUDA times are complete)."""
    phases: dict[str, Phases] = {name: {} for name in systems if name in ENGINE_SYSTEMS}
    with contextlib.ExitStack() as stack:
        runs: dict[str, Runs] = {}
        for name in systems:
            runs[name] = system_runs(
                name, model, context, prefill, log, device, vllm_venv, stack, phases.get(name)
            )
        cells = measure_runs(runs, rounds, prefill, log)
    if show_phases:
        for name, by_batch in phases.items():
            for n, split in sorted(by_batch.items()):
                log(
                    f"{name} decode step at {n:2d}: "
                    + ", ".join(f"{k} {ms(v)}" for k, v in split.items())
                )
    return cells


def system_runs(
    name: str,
    model: Path,
    context: int,
    prefill: int,
    log: Callable[[str], None],
    device: str,
    vllm_venv: Path | None,
    stack: contextlib.ExitStack,
    phases: Phases | None = None,
) -> Runs:
    if name in ENGINE_SYSTEMS:
        engine = make_engine(model, ENGINE_SYSTEMS[name], prefill, context, device)
        if not ENGINE_SYSTEMS[name].prefill_kernel:
            assert isinstance(engine.runner.backend, PagedCPUBackend), f"{name}: no paged-cpu"
            engine.runner.backend.prefill_lib = None
        if engine.runner.compile_report:
            log(f"{name}: {engine.runner.compile_report.line()}")
        return engine_runs(engine, context, prefill, phases)
    if name in GENERATE_SYSTEMS:
        hf = load_baseline_model(model, GENERATE_SYSTEMS[name])
        hf.to(device)  # type: ignore[arg-type]  # transformers types its `to` oddly
        return generate_runs(hf, context, prefill)
    if name == "vllm" and vllm_venv is not None and device == "cpu":
        log_path = Path(tempfile.gettempdir()) / "step_bench-vllm.log"
        log(f"starting vLLM on {model} (its log: {log_path})")
        length = max(2048, prefill + 1, context + DECODE_STEPS + 1)
        worker = stack.enter_context(VllmWorker(vllm_venv, model, log_path, max_model_len=length))
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
        return vllm_runs(worker, vocab, context, prefill)
    known = [*ENGINE_SYSTEMS, *GENERATE_SYSTEMS, "vllm (with --vllm-venv, on the cpu)"]
    raise SystemExit(f"unknown system {name!r}; use some of {', '.join(known)}")


def measure_runs(
    runs: dict[str, Runs], rounds: int, prefill: int, log: Callable[[str], None]
) -> list[Cell]:
    cells = [
        Cell(
            f"decode step, {n:2d} sequences",
            {s: functools.partial(r[0], n) for s, r in runs.items()},
        )
        for n in BATCHES
    ]
    cells.append(Cell(f"prefill {prefill} tokens", {s: r[1] for s, r in runs.items()}))
    with torch.inference_mode():
        for cell in cells:
            for r in range(rounds + 1):
                for system, run in cell.runs.items():
                    seconds = run(f"{cell.name}-{r}")
                    if r:  # round 0 warms up
                        cell.times[system].append(seconds)
            log(cell.line())
    return cells


def resolve_model(value: str | None) -> Path:
    """llama-25m (default), smollm2 (short for smollm2-135m), a built-in name, or a model dir."""
    from catalog.names import named_model_dir

    if value in (None, "llama-25m"):
        return default_llama_25m()
    assert value is not None
    name = "smollm2-135m" if value == "smollm2" else value
    return named_model_dir(name) or Path(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="model dir, or demo, llama-25m (default), smollm2")
    parser.add_argument("--systems", default="engine,sdpa,generate", help="comma list")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--prefill", type=int, default=1024, help="prompt tokens of the prefill")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N], for every system")
    parser.add_argument("--vllm-venv", type=Path, help="a venv with vllm(-cpu): system `vllm`")
    parser.add_argument(
        "--phases", action="store_true", help="engine decode steps split by phase, at the end"
    )
    args = parser.parse_args(argv)
    keep_freed_memory()  # before any system runs: the baselines get it too
    measure(
        resolve_model(args.model),
        args.systems.split(","),
        args.rounds,
        args.context,
        args.prefill,
        device=args.device,
        vllm_venv=args.vllm_venv,
        show_phases=args.phases,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The GPU decode-step table of issue 60: the engine against transformers' `generate`, and each
decode step against its memory roofline, on the 25M Llama, a Llama-3.2-1B and a Llama-3.1-8B.

`python -m benchmarks.gpu_decode_table [--models llama-25m,llama-3.2-1b,llama-3.1-8b]
[--batches 1,16,64,256] [--rounds 1] [--context 128] [--out DIR] [--dry-run]`

- Models: random weights in bfloat16, built on the device with `from_config` from hand-written
  configs (the 25M one is the engine benchmarks' `llama-25m`), nothing downloaded; a synthetic
  tokenizer of the model's vocabulary size (prompts are token ids).
- Systems: `generate` (transformers, SDPA, its dynamic cache: `step_bench.generate_decode_step`),
  `engine-eager` (`enforce_eager=True`), `engine-graphs` (the engine's default: decode steps
  replay CUDA graphs) and `engine-graphs-int4` (the same on the model's decoder linears in RTN
  int4, groups of 128, built in memory by `compress.grids.rtn` into the packed modules a packed
  artifact loads as: tinygemm on CUDA). Engine cells are `step_bench.engine_decode_step`:
  `n` prompts of `context` tokens prefilled in one step, then 32 decode steps timed whole.
- Roofline: the bytes one decode step must read (every weight but the input embedding's
  untouched rows, and the K and V of every sequence's context) over the GPU's peak memory
  bandwidth (by device name; elsewhere a measured device-to-device copy).
- GPU busy: the union of the GPU's activity intervals (`torch.profiler`) over the wall time
  of `PROFILED_STEPS` engine decode steps (for `generate`, of a whole call of that many new
  tokens); the profiler's own overhead makes it a lower bound.
Systems alternate within each round (one round by default: the GPU minutes are few), after
one untimed warm-up call each. `--dry-run` runs every code path on the CPU with tiny configs
(batches 1 and 4; graphs through the CPU stand-in backend) in seconds, its numbers meaningless.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from benchmarks.gpu_models import MODELS, build_model, rtn_int4, synthetic_tokenizer, tiny
from benchmarks.roofline import kv_bytes_read, peak_bandwidth, profiled, weight_bytes
from benchmarks.step_bench import (
    DECODE_STEPS,
    Cell,
    _generate,
    engine_decode_step,
    generate_decode_step,
    ms,
    prompt_ids,
)
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.core.sampling_params import SamplingParams
from serve.engine.llm_engine import LLMEngine
from serve.model.attention import ATTENTION_NAME
from serve.model.graphs import ReplayGraphBackend

SYSTEMS = ("generate", "engine-eager", "engine-graphs", "engine-graphs-int4")
BATCHES = (1, 16, 64, 256)
DRY_BATCHES = (1, 4)
PROFILED_STEPS = 4
BLOCK_SIZE = 16


def make_engine(
    model: PreTrainedModel, tokenizer: Any, batches: tuple[int, ...], context: int, eager: bool
) -> LLMEngine:
    """An engine over the loaded `model`, its KV cache sized for the largest batch, its
    budget holding that batch's whole prefill (so timed steps are decode steps only). Not
    `eager`: decode steps replay graphs (CUDA's; on the CPU the stand-in backend's, which
    replays the recorded body, so a dry run goes through the same buckets and buffers)."""
    most = max(batches)
    per_seq = -(-(context + DECODE_STEPS + 2) // BLOCK_SIZE)
    config = ModelConfig(
        "in-memory",
        dtype="bfloat16",
        device=str(model.device),
        prepack_linears=False,  # CPU-only rewrites: the dry run shares the model too
        fuse_layers=False,
        enforce_eager=eager,
    )
    model.set_attn_implementation(ATTENTION_NAME)
    engine = LLMEngine(
        config,
        CacheConfig(num_blocks=most * per_seq + most, block_size=BLOCK_SIZE),
        SchedulerConfig(
            max_num_seqs=most,
            max_num_batched_tokens=max(2048, most * context),
            max_model_len=per_seq * BLOCK_SIZE,
            enable_prefix_caching=False,
        ),
        loaded=(model, tokenizer),
    )
    if not eager and engine.runner.graphs is None:  # the CPU
        engine.runner.enable_graphs(ReplayGraphBackend(), most)
    return engine


System = tuple[Callable[[int, str], float], Callable[[int], float | None]]
"""A system's timed decode step at n sequences (given a request tag) and its GPU busy
fraction at n (`profiled`)."""


def generate_system(model: PreTrainedModel, context: int) -> System:
    vocab = model.get_output_embeddings().out_features

    def timed(n: int, tag: str) -> float:
        model.set_attn_implementation("sdpa")
        return generate_decode_step(model, n, context)

    def busy(n: int) -> float | None:
        model.set_attn_implementation("sdpa")
        ids = torch.tensor([prompt_ids(i, context, vocab) for i in range(n)])
        return profiled(lambda: _generate(model, ids, PROFILED_STEPS), model.device)

    return timed, busy


def engine_system(engine: LLMEngine, context: int) -> System:
    model = engine.runner.model

    def timed(n: int, tag: str) -> float:
        model.set_attn_implementation(ATTENTION_NAME)
        return engine_decode_step(engine, n, context, tag)

    def busy(n: int) -> float | None:
        model.set_attn_implementation(ATTENTION_NAME)
        params = SamplingParams(max_tokens=PROFILED_STEPS + 1, temperature=0, ignore_eos=True)
        for i in range(n):
            ids = prompt_ids(i, context, engine.vocab_size)
            engine.add_request(f"profiled-{n}-{i}", ids, params)
        engine.step()  # the whole prefill (`make_engine`)
        fraction = profiled(lambda: _steps(engine, PROFILED_STEPS), engine.runner.device)
        while engine.has_unfinished_requests():
            engine.step()
        return fraction

    return timed, busy


def _steps(engine: LLMEngine, count: int) -> None:
    for _ in range(count):
        engine.step()


@dataclass(frozen=True)
class Row:
    """One cell of the table."""

    model: str
    system: str
    sequences: int
    seconds: float
    """Median decode step over the rounds."""
    roofline_seconds: float
    busy: float | None
    """GPU busy fraction of a decode step; None off the GPU."""


@dataclass(frozen=True)
class Setup:
    device: torch.device
    batches: tuple[int, ...]
    rounds: int
    context: int
    bandwidth: float
    """Peak memory bandwidth, bytes/s (`peak_bandwidth`)."""


def measure_model(
    name: str, config: PretrainedConfig, setup: Setup, log: Callable[[str], None]
) -> list[Row]:
    """Every system's decode step at each batch size, alternating per round, with its
    roofline and GPU busy fraction; the models and engines are freed after."""
    model = build_model(config, setup.device)
    int4 = rtn_int4(model)
    tokenizer = synthetic_tokenizer(config.vocab_size)
    args = (tokenizer, setup.batches, setup.context)
    systems: dict[str, tuple[System, PreTrainedModel]] = {
        "generate": (generate_system(model, setup.context), model),
        "engine-eager": (engine_system(make_engine(model, *args, True), setup.context), model),
        "engine-graphs": (engine_system(make_engine(model, *args, False), setup.context), model),
        "engine-graphs-int4": (
            engine_system(make_engine(int4, *args, False), setup.context),
            int4,
        ),
    }
    weights = {s: weight_bytes(m) for s, (_, m) in systems.items()}
    log(
        f"{name}: weights read a step {weights['generate'] / 1e9:.3f} GB in bfloat16, "
        f"{weights['engine-graphs-int4'] / 1e9:.3f} GB in int4"
    )
    for system, ((timed, _), _) in systems.items():
        timed(setup.batches[0], f"warm-up-{system}")
    rows = []
    for n in setup.batches:
        cell = Cell(
            f"{name} decode step, {n} sequences",
            {s: functools.partial(timed, n) for s, ((timed, _), _) in systems.items()},
        )
        for r in range(setup.rounds):
            for system, run in cell.runs.items():
                cell.times[system].append(run(f"{n}-{r}"))
        log(cell.line())
        kv = kv_bytes_read(model, n, setup.context)
        for system, ((_, busy), _) in systems.items():
            roofline = (weights[system] + kv) / setup.bandwidth
            seconds = statistics.median(cell.times[system])
            rows.append(Row(name, system, n, seconds, roofline, busy(n)))
    del systems, model, int4
    gc.collect()
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def cell_text(row: Row) -> str:
    busy = "n/a" if row.busy is None else f"{row.busy:.0%}"
    return f"{ms(row.seconds)} (x{row.seconds / row.roofline_seconds:.1f} roofline, busy {busy})"


def table(rows: list[Row]) -> str:
    """A markdown table per model: batch sizes down, systems across."""
    out = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        out += [f"### {model}", "", "| sequences | " + " | ".join(SYSTEMS) + " |"]
        out.append("|---" * (len(SYSTEMS) + 1) + "|")
        for n in dict.fromkeys(r.sequences for r in mine):
            by = {r.system: r for r in mine if r.sequences == n}
            out.append(f"| {n} | " + " | ".join(cell_text(by[s]) for s in SYSTEMS) + " |")
        out.append("")
    return "\n".join(out)


def _find(rows: list[Row], model: str, system: str, n: int) -> Row | None:
    return next((r for r in rows if (r.model, r.system, r.sequences) == (model, system, n)), None)


def targets(rows: list[Row]) -> list[str]:
    """Issue 60's targets, each with its figure or "unmeasured"."""
    lines = [
        _target(
            "25M, 64 sequences: engine graphs >= 2x faster than generate",
            _speedup(rows, "llama-25m", "generate", "engine-graphs", 64),
            2.0,
        )
    ]
    for model in ("llama-3.2-1b", "llama-3.1-8b"):
        for n in (1, 16, 64):
            row = _find(rows, model, "engine-graphs", n)
            lines.append(
                _target(
                    f"{model}, {n} sequences: within 1.5x of the roofline",
                    row.seconds / row.roofline_seconds if row else None,
                    1.5,
                    at_most=True,
                )
            )
    for row in rows:
        if row.system == "engine-graphs" and row.sequences >= 16:
            what = f"{row.model}, {row.sequences} sequences: GPU busy >= 85%"
            lines.append(_target(what, row.busy, 0.85))
    speedup = _speedup(rows, "llama-3.1-8b", "engine-graphs", "engine-graphs-int4", 1)
    lines.append(_target("8B, 1 sequence: int4 >= 2x faster than bfloat16", speedup, 2.0))
    return lines


def _speedup(rows: list[Row], model: str, slow: str, fast: str, n: int) -> float | None:
    """How many times `fast`'s step fits in `slow`'s (None: either unmeasured)."""
    a, b = _find(rows, model, slow, n), _find(rows, model, fast, n)
    return a.seconds / b.seconds if a and b else None


def _target(what: str, value: float | None, bound: float, at_most: bool = False) -> str:
    if not value:
        return f"- {what}: unmeasured"
    met = value <= bound if at_most else value >= bound
    return f"- {what}: {value:.2f} ({'met' if met else 'not met'})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--models", default=",".join(MODELS), help="comma list of " + ", ".join(MODELS)
    )
    parser.add_argument("--batches", help="comma list of sequence counts (default 1,16,64,256)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--context", type=int, help="prompt tokens per sequence (default 128)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, help="a dir for table.md and table.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny configs on the CPU")
    args = parser.parse_args(argv)
    default_batches = DRY_BATCHES if args.dry_run else BATCHES
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else default_batches
    device = torch.device("cpu" if args.dry_run else args.device)
    bandwidth, source = peak_bandwidth(device)
    context = args.context or (16 if args.dry_run else 128)
    setup = Setup(device, batches, args.rounds, context, bandwidth)
    print(
        f"{source} {bandwidth / 1e12:.2f} TB/s; torch {torch.__version__}"
        + ("; DRY RUN (tiny models on the CPU: no figure means anything)" if args.dry_run else "")
    )
    rows: list[Row] = []
    for name in args.models.split(","):
        config = MODELS[name]()
        rows += measure_model(name, tiny(config) if args.dry_run else config, setup, print)
        write(rows, args.out)
    print(table(rows))
    print("\n".join(targets(rows)))
    return 0


def write(rows: list[Row], out: Path | None) -> None:
    """The table so far (each model's rows as soon as it is measured)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table(rows) + "\n" + "\n".join(targets(rows)) + "\n")
    (out / "table.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    raise SystemExit(main())

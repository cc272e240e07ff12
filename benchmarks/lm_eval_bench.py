"""lm-eval's HFLM against `ContinuationLM` and the engine (`EngineLM`) on the same model, tasks
and documents.

`python -m benchmarks.lm_eval_bench [--model gemma3-270m] [--tasks hellaswag,arc_easy,piqa]
[--limit 40] [--batch-size 16] [--max-length 512] [--rounds 2]
[--systems hflm,continuation,engine] [--dtype float32] [--hflm-softmax-dtype float32|float64]`
(`engine-bN`: the engine with KV blocks of N tokens, e.g. `--systems hflm,engine-b16,engine`)

Model: every system scores the same seeded document subsets in `--dtype` (the recipe's quality
settings); the systems alternate round by round and each one's median wall time is reported,
with its speed against HFLM's, and whether every logged answer agrees with HFLM's
(log-likelihoods within 1e-3 nats, accuracies equal). HFLM takes the log-softmax in the model's
dtype unless `--hflm-softmax-dtype float32` (lm-eval's `softmax_dtype`); `ContinuationLM` and the
engine always take it in float32, so in bfloat16 only that setting compares the models alone.
Malloc is tuned as the engine tunes it (`keep_freed_memory`) before any system runs: it is
process-wide, so the baselines get it too.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from typing import Any

import torch
from transformers import AutoTokenizer

from benchmarks.step_bench import resolve_model
from compress.load_model import load_model
from evals.quality import TaskRequest, run_tasks
from serve.model.host_memory import keep_freed_memory

ENGINE_BLOCKS = re.compile(r"engine-b[1-9][0-9]*")


def _system(name: str, model: Any, tokenizer: Any, model_dir: Any, args: Any) -> Any:
    from lm_eval.models.huggingface import HFLM

    from evals.continuation_lm import ContinuationLM
    from evals.engine_lm import BLOCK_SIZE, EngineLM

    if name.startswith("engine"):
        block = int(name[len("engine-b") :]) if name != "engine" else BLOCK_SIZE
        return EngineLM(model_dir, dtype=args.dtype, max_length=args.max_length, block_size=block)
    if name == "continuation":
        return ContinuationLM(
            pretrained=model,
            tokenizer=tokenizer,
            batch_size=args.batch_size,
            max_length=args.max_length,
        )
    return HFLM(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=args.batch_size,
        max_length=args.max_length,
        softmax_dtype=args.hflm_softmax_dtype,
    )


def _answers(results: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    out = {}
    for task, samples in results["samples"].items():
        rows = sorted(samples, key=lambda s: s["doc_id"])
        out[task] = [(float(r[0][0]), s["acc"]) for s in rows for r in s["resps"]]
    return out


def _agreement(
    a: dict[str, list[tuple[float, float]]], b: dict[str, list[tuple[float, float]]]
) -> str:
    """Whether every answer agrees (log-likelihoods within 1e-3 nats, accuracies equal), with
    the largest log-likelihood difference and the number of answers whose accuracy differs."""
    if a.keys() != b.keys() or any(len(a[t]) != len(b[t]) for t in a):
        return "False (different requests)"
    pairs = [(x, p, y, q) for t in a for (x, p), (y, q) in zip(a[t], b[t], strict=True)]
    delta = max(abs(x - y) for x, _, y, _ in pairs)
    changed = sum(p != q for _, p, _, q in pairs)
    agree = delta <= 1e-3 and changed == 0
    return (
        f"{agree} (max |d log-lik| {delta:.1e} nats, accuracy changed on {changed} of {len(pairs)})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gemma3-270m", help="built-in name or model dir")
    parser.add_argument("--tasks", default="hellaswag,arc_easy,piqa")
    parser.add_argument("--limit", type=int, default=40, help="documents per task (seeded subset)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", default="hflm,continuation,engine")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--hflm-softmax-dtype",
        default=None,
        choices=["float32", "float64"],
        help="HFLM's log-softmax dtype (default: the model's, lm-eval's own default; float64: "
        "the exact reference, as float32's log-softmax over a 262k vocabulary errs by up to 1e-4 "
        "nats a token)",
    )
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    known = {"hflm", "continuation", "engine"}
    if "hflm" not in systems or any(
        s not in known and not ENGINE_BLOCKS.fullmatch(s) for s in systems
    ):
        parser.error(
            "--systems: a comma list of hflm (required: the baseline), continuation, engine, "
            "engine-bN (KV blocks of N tokens)"
        )
    keep_freed_memory()  # before any system runs: the baselines get it too
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir, dtype=getattr(torch, args.dtype))  # packed variants too
    requests = [TaskRequest(t, limit=args.limit) for t in args.tasks.split(",")]
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    answers: dict[str, Any] = {}
    for round_ in range(args.rounds):
        order = list(seconds) if round_ % 2 == 0 else list(reversed(seconds))
        for name in order:
            lm = _system(name, model, tokenizer, model_dir, args)
            start = time.perf_counter()
            answers[name] = _answers(run_tasks(lm, None, requests, None, True))
            seconds[name].append(time.perf_counter() - start)
            print(f"round {round_ + 1} {name:12s} {seconds[name][-1]:7.1f} s", flush=True)
    hflm = statistics.median(seconds["hflm"])
    print(
        f"{model_dir.name}: {args.tasks} x {args.limit} docs, {args.dtype}, median of {args.rounds}"
        f", HFLM's log-softmax in {args.hflm_softmax_dtype or args.dtype}"
    )
    for name in systems:
        median = statistics.median(seconds[name])
        agree = _agreement(answers["hflm"], answers[name])
        print(
            f"  {name:12s} {median:7.1f} s  {hflm / median:.2f}x HFLM's speed  answers agree: {agree}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

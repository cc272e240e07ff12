"""Training-step time of distillation: the full-vocabulary KD loss (teacher run every step)
against the top-k KD loss on windows already cached (teacher skipped) and on new windows.

`python -m benchmarks.kd_bench [--model smollm2] [--layers 24] [--top-k 64] [--batch-size 4]
[--seq-len 128] [--steps 4] [--rounds 3]`

Model: one student (the teacher's `--layers` evenly kept), one AdamW step per batch, float32,
the demo's loss settings (alpha 0.9, T 1). Per round each system trains `--steps` batches, the
systems alternating; `top-k, new windows` fills a fresh cache (its teacher pass plus the top-k),
`top-k, cached` then trains on the same windows again. Medians of the per-step times are
reported, with the ratio to the full loss.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.step_bench import resolve_model
from catalog.data import NAMED
from compress.data import load_texts, token_rows
from compress.distill import DistillParams, TopKD, _distill_loss, kept_layers, student_from
from compress.kd_loss import TopKCache


def _steps(
    student: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    batches: list[torch.Tensor],
) -> list[float]:
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)
    times = []
    for batch in batches:
        start = time.perf_counter()
        loss = loss_fn(student, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", help="built-in name or model dir")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    teacher.requires_grad_(False)
    rows = token_rows(tok, load_texts("corpus", "train", NAMED), args.seq_len)
    full = DistillParams(layers=args.layers, alpha=0.9, temperature=1.0)
    top_k = DistillParams(
        layers=args.layers, alpha=0.9, temperature=1.0, kd=TopKD(top_k=args.top_k)
    )
    keep = kept_layers(args.layers, teacher.config.num_hidden_layers)
    times: dict[str, list[float]] = {"full": [], "top-k, new windows": [], "top-k, cached": []}
    for round_ in range(args.rounds):
        at = round_ * args.steps * args.batch_size
        batches = [
            rows[at + i * args.batch_size : at + (i + 1) * args.batch_size]
            for i in range(args.steps)
        ]
        cache = TopKCache(args.top_k, 1.0)
        order = ["full", "top-k"] if round_ % 2 == 0 else ["top-k", "full"]
        for system in order:
            student = student_from(teacher, full, 0, keep).train()
            if system == "full":
                times["full"] += _steps(student, _distill_loss(teacher, full, None), batches)
            else:
                loss = _distill_loss(teacher, top_k, cache)
                times["top-k, new windows"] += _steps(student, loss, batches)
                times["top-k, cached"] += _steps(student, loss, batches)
        print(
            f"round {round_ + 1}: "
            + ", ".join(f"{k} {1000 * v[-1]:.0f} ms" for k, v in times.items()),
            flush=True,
        )
    base = statistics.median(times["full"])
    for name, values in times.items():
        median = statistics.median(values)
        print(
            f"{name:20s} {1000 * median:7.0f} ms/step (median of {len(values)})  {base / median:.2f}x the full loss's speed"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

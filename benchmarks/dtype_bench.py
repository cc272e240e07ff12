"""The engine in bfloat16 against float32 on the CPU: speed and quality, so a user can choose.

`python -m benchmarks.dtype_bench [--model smollm2] [--data corpus,shakespeare] [--windows 32]
[--prompts 32] [--max-tokens 64] [--rounds 2] [--out reports/dtype-bench.json]`

- Speed: decode step at 1/16/64 sequences and prefill of 1,024 tokens (`benchmarks.step_bench`),
  float32 and bfloat16 engines alternating round by round.
- Next-token quality: the bfloat16 model against the float32 one on the same held-out windows
  (`evals.divergence`: mean KL, top-1 agreement, both perplexities, with standard errors over
  windows).
- Greedy agreement: both engines continue the same prompts (the first 32-256 tokens of held-out
  documents) greedily for `--max-tokens`; reported: the share of identical continuations and the
  mean position of the first different token (`--max-tokens` when identical).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.step_bench import measure, resolve_model
from evals.divergence import divergence, scored_bytes
from serve.core.config import SchedulerConfig
from serve.core.sampling_params import SamplingParams
from serve.engine.llm import LLM


def held_out(tokenizer: Any, name: str, seq_len: int) -> torch.Tensor:
    from catalog.data import NAMED
    from compress.data import load_texts, token_rows

    return token_rows(tokenizer, load_texts(name, "validation", NAMED), seq_len)


def quality(model_dir: Path, data: list[str], windows: int) -> dict[str, Any]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    out = {}
    for name in data:
        rows = held_out(tokenizer, name, 256)[:windows]
        out[name] = divergence(fp32, bf16, rows, scored_bytes(tokenizer, rows))
        r = out[name]
        print(
            f"{name}: ppl float32 {r['reference_perplexity']:.3f}, bfloat16 {r['perplexity']:.3f}"
            f"; KL {r['kl_mean']:.5f} ± {r['kl_stderr']:.5f}; top-1 agreement "
            f"{r['top1_agreement']:.2%} ± {r['top1_agreement_stderr']:.2%} "
            f"({r['windows']} windows, {r['tokens']} tokens)",
            flush=True,
        )
    return out


def greedy_agreement(model_dir: Path, data: list[str], n: int, max_tokens: int) -> dict[str, Any]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = torch.cat([held_out(tokenizer, name, 256)[-n:] for name in data])
    lengths = [32 + (i * 37) % 225 for i in range(len(rows))]
    prompts = [row[:k].tolist() for row, k in zip(rows, lengths)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = {
        dtype: [
            c.token_ids
            for c in LLM(
                model_dir, dtype=dtype, device="cpu", scheduler=SchedulerConfig(max_num_seqs=64)
            ).generate(prompts, params)
        ]
        for dtype in ("float32", "bfloat16")
    }
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), max_tokens)
        for x, y in zip(outputs["float32"], outputs["bfloat16"])
    ]
    result = {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "identical": sum(d == max_tokens for d in first_diff) / len(prompts),
        "mean_first_difference": statistics.fmean(first_diff),
        "median_first_difference": statistics.median(first_diff),
    }
    print(
        f"greedy, {len(prompts)} prompts x {max_tokens} tokens: {result['identical']:.0%} "
        f"identical; first different token at {result['mean_first_difference']:.1f} on average "
        f"(median {result['median_first_difference']})",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2", help="model dir, or demo, llama-25m, smollm2")
    parser.add_argument("--data", default="corpus,shakespeare", help="named held-out data sets")
    parser.add_argument("--windows", type=int, default=32, help="256-token windows per data set")
    parser.add_argument("--prompts", type=int, default=16, help="greedy prompts per data set")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="speed rounds (0: quality only)")
    parser.add_argument("--out", default="reports/dtype-bench.json")
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    data = args.data.split(",")
    cells = measure(model, ["engine", "engine-bf16"], args.rounds, 128, 1024) if args.rounds else []
    result = {
        "model": args.model,
        "threads": torch.get_num_threads(),
        "speed_ms": {c.name: {s: [t * 1000 for t in v] for s, v in c.times.items()} for c in cells},
        "quality": quality(model, data, args.windows),
        "greedy": greedy_agreement(model, data, args.prompts, args.max_tokens),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

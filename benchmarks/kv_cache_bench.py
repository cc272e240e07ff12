"""The int8 KV cache against the float one: capacity at the same budget, decode speed, and what it
costs in quality.

`python -m benchmarks.kv_cache_bench [--model smollm2] [--kv-budget 64MiB] [--requests 48]
[--prompt-len 128] [--max-tokens 64] [--decode-batch 64] [--rounds 3] [--data corpus,shakespeare]
[--windows 8] [--seq-len 256] [--out reports/kv-cache.json]`

Model: the same engine (float32 model, default attention backend) with `kv_cache_dtype` auto and
int8, in one process, systems alternating round by round:
- capacity: `--requests` greedy requests of `--prompt-len` + `--max-tokens` tokens (end of
  sequence ignored) all queued at once under a `--kv-budget` KV cache: the most sequences running
  at once (the saturation concurrency: past it requests wait for blocks), preemptions, and output
  tokens per second;
- decode: seconds per step of `--decode-batch` sequences (128-token contexts) with ample KV;
- one warm-up pass of both, not counted, then `--rounds` rounds;
- quality: the float32 model with keys and values rounded to int8 exactly as the cache stores
  them (`evals.int8_kv`: `quantize_int8` per token and KV head, then SDPA over the dequantized
  values)
  against the plain model on held-out windows (`evals.divergence`: KL, top-1 agreement,
  perplexity, standard errors over windows), and the engine's own top-1 agreement on the same
  windows (teacher-forced prompt logprobs, int8 against float cache) as a check that the engine
  computes what the rounded model does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.dtype_bench import held_out
from benchmarks.engine_bench import run_engine
from benchmarks.step_bench import engine_decode_step, resolve_model
from benchmarks.workloads import Workload
from evals.divergence import divergence, scored_bytes
from evals.int8_kv import int8_kv_attention
from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.http.flags import parse_size

DTYPES = ("auto", "int8")


def make_engine(model: Path, kv_cache_dtype: str, cache: CacheConfig, seqs: int) -> LLMEngine:
    return LLMEngine(
        ModelConfig(str(model), dtype="float32", device="cpu"),
        replace(cache, kv_cache_dtype=kv_cache_dtype),  # type: ignore[arg-type]
        SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=2048),
    )


def capacity_and_decode(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    budget = CacheConfig(block_size=16, kv_cache_bytes=parse_size(args.kv_budget))
    ample = CacheConfig(block_size=16, num_blocks=args.decode_batch * 16)
    engines = {d: make_engine(model, d, budget, args.requests) for d in DTYPES}
    decoders = {d: make_engine(model, d, ample, args.decode_batch) for d in DTYPES}
    vocab = engines["auto"].vocab_size
    prompts = [
        [(7 * i + 13 * j) % (vocab - 10) + 10 for j in range(args.prompt_len)]
        for i in range(args.requests)
    ]
    work = Workload("capacity", prompts, [args.max_tokens] * args.requests)
    runs: dict[str, dict[str, list[float]]] = {d: {} for d in DTYPES}
    for d in DTYPES:  # warm-up, not counted: the first pass faults in every KV and weight page
        run_engine(engines[d], work)
        engine_decode_step(decoders[d], args.decode_batch, 128, f"{d}-warm-up")
    for r in range(args.rounds):
        for d in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            before = engines[d].stats().num_preemptions
            measured = run_engine(engines[d], work)
            step = engine_decode_step(decoders[d], args.decode_batch, 128, f"{d}-{r}")
            row = {
                "output_tok_s": work.output_tokens / measured.seconds,
                "peak_running": measured.extra["peak_running"],
                "preemptions": measured.extra["preemptions"] - before,
                "decode_step_ms": step * 1e3,
            }
            for k, v in row.items():
                runs[d].setdefault(k, []).append(v)
            print(
                f"round {r} {d:5s} " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True
            )
    out: dict[str, Any] = {}
    for d in DTYPES:
        e = engines[d]
        out[d] = {
            "num_blocks": e.runner.num_blocks,
            "kv_tokens": e.runner.num_blocks * e.cache_config.block_size,
            "bytes_per_token": e.runner.layout.bytes_per_token(),
            "runs": runs[d],
        }
    ratios = {
        k: [a / b for a, b in zip(runs["int8"][k], runs["auto"][k])]
        for k in ("output_tok_s", "peak_running", "decode_step_ms")
    }
    out["int8_over_float"] = {
        k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in ratios.items()
    }
    return out


def engine_agreement(engines: dict[str, LLMEngine], rows: torch.Tensor) -> float:
    """Top-1 agreement of the int8-cache engine with the float-cache engine, teacher-forced."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    tops = {}
    for d, engine in engines.items():
        for i, row in enumerate(rows.tolist()):
            engine.add_request(str(i), row, params)
        got: dict[int, list[int]] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    got[int(o.request_id)] = [
                        max(lp, key=lp.__getitem__) for lp in o.prompt_logprobs[1:] if lp
                    ]
        tops[d] = torch.tensor([t for i in range(len(rows)) for t in got[i]])
    return (tops["auto"] == tops["int8"]).float().mean().item()


def quality(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    rounded = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation=int8_kv_attention()
    ).eval()
    cache = CacheConfig(block_size=16, num_blocks=1024)
    engines = {d: make_engine(model, d, cache, 64) for d in DTYPES}
    out = {}
    for name in args.data.split(","):
        rows = held_out(tokenizer, name, args.seq_len)[: args.windows]
        r = divergence(plain, rounded, rows, scored_bytes(tokenizer, rows))
        r["engine_top1_agreement"] = engine_agreement(engines, rows)
        out[name] = r
        print(
            f"{name}: KL {r['kl_mean']:.5f} ± {r['kl_stderr']:.5f}, top-1 {r['top1_agreement']:.2%}"
            f" ± {r['top1_agreement_stderr']:.2%} (engine {r['engine_top1_agreement']:.2%}), ppl "
            f"{r['perplexity']:.3f} vs {r['reference_perplexity']:.3f}",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2", help="built-in name or model dir")
    p.add_argument("--kv-budget", default="64MiB")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", default="corpus,shakespeare")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per quality window")
    p.add_argument("--skip", choices=["quality", "speed"], help="leave one part out")
    p.add_argument("--out", default="reports/kv-cache.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = resolve_model(args.model)
    result: dict[str, Any] = {"model": str(model), "settings": vars(args)}
    start = time.perf_counter()
    if args.skip != "speed":
        result["serving"] = capacity_and_decode(args, model)
        print(json.dumps(result["serving"]["int8_over_float"], indent=1))
    if args.skip != "quality":
        result["quality"] = quality(args, model)
    result["seconds"] = round(time.perf_counter() - start, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The fused decoder-layer kernels (`serve/model/fused_layers.py`) against the transformers
modules they replace, per op, side by side in one process.

`python -m benchmarks.fused_ops_bench [--rounds 5] [--dtype float32|bfloat16]`

On the 25M Llama's shapes (hidden 512, 8 heads and 4 KV heads of 64, intermediate 1280) at 1, 64
and 1,024 rows: RMSNorm (`LlamaRMSNorm` against `rms_norm`), the rotary embedding of q and k
(`apply_rotary_pos_emb` against `rotary` in place on the merged projection's columns), and SiLU
x up (`F.silu(gate) * up` against `silu_mul`). Each round times every pair in alternation; the
cell is the median of the rounds' µs a call, the ratio the median of per-round ratios (torch /
fused) with min-max.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from serve.model.fused_layers import FusedOps, load_ops
from serve.model.host_memory import keep_freed_memory

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 512, 8, 4, 64, 1280
ROWS = (1, 64, 1024)


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def pairs(ops: FusedOps, rows: int, dtype: torch.dtype) -> dict[str, tuple[Callable, Callable]]:
    """op name -> (transformers' way, the fused kernel), on fresh inputs of `rows` rows."""
    x = torch.randn(rows, HIDDEN).to(dtype)
    norm = LlamaRMSNorm(HIDDEN).to(dtype)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    q, k = qkv[:, : HEADS * HEAD_DIM], qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM]
    q4 = q.view(1, rows, HEADS, HEAD_DIM).transpose(1, 2)
    k4 = k.view(1, rows, KV_HEADS, HEAD_DIM).transpose(1, 2)
    cos, sin = torch.randn(rows, HEAD_DIM).to(dtype), torch.randn(rows, HEAD_DIM).to(dtype)
    gate_up = torch.randn(rows, 2 * INTERMEDIATE).to(dtype)
    gate, up = gate_up[:, :INTERMEDIATE], gate_up[:, INTERMEDIATE:]

    def rotary() -> None:
        ops.rotary(q, HEADS, cos, sin)
        ops.rotary(k, KV_HEADS, cos, sin)

    return {
        "rms_norm": (lambda: norm(x), lambda: ops.rms_norm(x, norm.weight, 1e-6)),
        "rotary q+k": (lambda: apply_rotary_pos_emb(q4, k4, cos[None], sin[None]), rotary),
        "silu x up": (lambda: F.silu(gate) * up, lambda: ops.silu_mul(gate, up)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    lib = load_ops()
    if lib is None:
        raise SystemExit("the fused-op kernels cannot be built here (no C compiler: set CC)")
    keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    ops = FusedOps(lib, dtype)
    print(f"{torch.get_num_threads()} threads, {args.dtype}; µs a call, median of {args.rounds}")
    with torch.inference_mode():
        for rows in ROWS:
            calls = max(5, 2000 // rows)
            for name, (plain, fused) in pairs(ops, rows, dtype).items():
                times = [
                    (per_call_us(plain, calls), per_call_us(fused, calls))
                    for _ in range(args.rounds)
                ]
                ratios = [p / f for p, f in times]
                print(
                    f"{rows:5d} rows {name:>11}: transformers {statistics.median(p for p, _ in times):8.1f}"
                    f"  fused {statistics.median(f for _, f in times):8.1f}"
                    f"  = x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

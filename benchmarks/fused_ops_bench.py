"""The fused decoder-layer kernels (`serve/model/fused_ops.py`) against the transformers
modules they replace, per op, side by side in one process.

`python -m benchmarks.fused_ops_bench [--shapes llama|gemma] [--rounds 5] [--dtype float32|bfloat16]`

At 1, 64 and 1,024 rows, on the 25M Llama's shapes (hidden 512, 8 heads and 4 KV heads of 64,
intermediate 1280): RMSNorm (`LlamaRMSNorm` against `rms_norm`), the rotary embedding of q and k
(`apply_rotary_pos_emb` against `rotary` in place on the merged projection's columns), and SiLU
x up (`F.silu(gate) * up` against `act_mul`); on Gemma 3 270M's (hidden 640, 4 heads and 1 KV
head of 256, intermediate 2048): `Gemma3RMSNorm`, the q/k norms with the rotary embedding, and
GELU (tanh) x up. Each round times every pair in alternation; the cell is the median of the
rounds' µs a call, the ratio the median of per-round ratios (torch / fused) with min-max.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from serve.model.fused_ops import FusedOps, NormWeight, load_ops
from serve.model.host_memory import keep_freed_memory

SHAPES = {  # hidden, heads, KV heads, head dim, intermediate
    "llama": (512, 8, 4, 64, 1280),
    "gemma": (640, 4, 1, 256, 2048),
}
ROWS = (1, 64, 1024)


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def pairs(
    ops: FusedOps, rows: int, dtype: torch.dtype, shapes: str
) -> dict[str, tuple[Callable, Callable]]:
    """op name -> (transformers' way, the fused kernel), on fresh inputs of `rows` rows."""
    hidden, heads, kv_heads, head_dim, intermediate = SHAPES[shapes]
    gemma = shapes == "gemma"
    norm_class = Gemma3RMSNorm if gemma else LlamaRMSNorm
    x = torch.randn(rows, hidden).to(dtype)
    norm, q_norm = norm_class(hidden).to(dtype), norm_class(head_dim).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    cos, sin = torch.randn(rows, head_dim).to(dtype), torch.randn(rows, head_dim).to(dtype)
    gate_up = torch.randn(rows, 2 * intermediate).to(dtype)
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    weights, head_weights = NormWeight.of(norm), NormWeight.of(q_norm) if gemma else None

    def heads_of(t: torch.Tensor, n: int) -> torch.Tensor:
        t = t.view(1, rows, n, head_dim)
        return (q_norm(t) if gemma else t).transpose(1, 2)

    def rotary() -> None:
        ops.rotary(q, heads, cos, sin, head_weights)
        ops.rotary(k, kv_heads, cos, sin, head_weights)

    def plain_rotary() -> object:
        return apply_rotary_pos_emb(heads_of(q, heads), heads_of(k, kv_heads), cos[None], sin[None])

    act, code = (lambda g: F.gelu(g, approximate="tanh"), 1) if gemma else (F.silu, 0)
    return {
        "rms_norm": (lambda: norm(x), lambda: ops.rms_norm(x, weights)),
        "q/k norm+rotary" if gemma else "rotary q+k": (plain_rotary, rotary),
        "gelu x up" if gemma else "silu x up": (
            lambda: act(gate) * up,
            lambda: ops.act_mul(gate, up, code),
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    lib = load_ops()
    if lib is None:
        raise SystemExit("the fused-op kernels cannot be built here (no C compiler: set CC)")
    keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    ops = FusedOps(lib, dtype)
    print(
        f"{args.shapes} shapes, {torch.get_num_threads()} threads, {args.dtype}; "
        f"µs a call, median of {args.rounds}"
    )
    with torch.inference_mode():
        for rows in ROWS:
            calls = max(5, 2000 // rows)
            for name, (plain, fused) in pairs(ops, rows, dtype, args.shapes).items():
                times = [
                    (per_call_us(plain, calls), per_call_us(fused, calls))
                    for _ in range(args.rounds)
                ]
                ratios = [p / f for p, f in times]
                print(
                    f"{rows:5d} rows {name:>15}: transformers {statistics.median(p for p, _ in times):8.1f}"
                    f"  fused {statistics.median(f for _, f in times):8.1f}"
                    f"  = x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a quantized variant's divergence comes from: its weights, or the kernels' compute dtype.

`python -m benchmarks.weight_error [--model gemma3-270m] [--cases bf16-linears,int8,int8-g32,...]
[--data corpus,shakespeare] [--windows 8] [--seq-len 256] [--out reports/weight-error.json]`

Model: every case changes the float32 model's linears (not the embedding or the head) and is
scored against the untouched model on the same held-out windows (`evals.divergence`: KL, top-1
agreement, perplexity, standard errors over windows):
- `bf16-linears`: the weights as they are, each linear computed in bfloat16 (what torch's int4 /
  int8 CPU kernels do to the activations): the compute dtype's own cost;
- `int8`, `int8-g32`, `int8-g128` (symmetric round-to-nearest), `int4-g128` (GPTQ's grid),
  `hqq-g128`: the weights fake-quantized (quantized and dequantized, computed in float32): the
  format's own cost, kernels aside; groups on int8 are what torch's int8 kernel cannot run;
- `int4-g128-mse`: GPTQ's grid with the reference quantizer's `mse` range search (per row of a
  group, the range shrunk by 0 .. 80% in steps of 1% to minimise the l_2.4 error of the
  group's weights): clipping traded for resolution, as GPTQ's and gptqmodel's `mse` option do;
- `hqq-g128-slow`: HQQ with the library's `optimize_weights_proximal_slow` solver (100
  iterations, no early stop) instead of its default one, to show whether the solver has
  converged;
- `gptq-int8` (symmetric per channel, act-order, 64 x 512 calibration tokens of the corpus's
  train split), likewise fake-quantized.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.dtype_bench import held_out
from benchmarks.step_bench import resolve_model
from compress.grids import Grid, hqq, rtn
from compress.packed import PackedFormat
from evals.divergence import divergence, scored_bytes

CASES = (
    "bf16-linears",
    "int8",
    "int8-g32",
    "int8-g128",
    "int4-g128",
    "int4-g128-mse",
    "hqq-g128",
    "hqq-g128-slow",
    "gptq-int8",
)
Weights = Callable[[torch.Tensor], torch.Tensor]


def _formats() -> dict[str, Weights]:
    def sym(bits: int, group: int | None) -> Weights:
        return lambda w: rtn(w, PackedFormat(bits, group), sym=True).dequantize()

    return {
        "int8": sym(8, None),
        "int8-g32": sym(8, 32),
        "int8-g128": sym(8, 128),
        "int4-g128": lambda w: rtn(w, PackedFormat(4, 128)).dequantize(),
        "hqq-g128": lambda w: hqq(w, PackedFormat(4, 128)).dequantize(),
        "hqq-g128-slow": lambda w: _hqq_slow(w, PackedFormat(4, 128)),
        "int4-g128-mse": lambda w: _rtn_mse(w, PackedFormat(4, 128)),
    }


def _rtn_mse(
    w: torch.Tensor, fmt: PackedFormat, norm: float = 2.4, grid: int = 100, max_shrink: float = 0.8
) -> torch.Tensor:
    """GPTQ's asymmetric grid fitted with the reference quantizer's `mse` search: per row of a
    group, of the ranges `p * [min(w, 0), max(w, 0)]` for p = 1, 0.99, .. (max_shrink * grid
    steps), the one whose rounding has the least l_`norm` error; returned dequantized."""
    group = fmt.group_size or w.shape[1]
    rows = w.float().reshape(-1, group)
    zeros = torch.zeros(rows.shape[0])
    low, high = torch.minimum(rows.min(1).values, zeros), torch.maximum(rows.max(1).values, zeros)
    maxq = 2**fmt.bits - 1
    best_error = torch.full_like(low, float("inf"))
    best = torch.empty_like(rows)
    for step in range(int(max_shrink * grid)):
        shrink = 1 - step / grid
        scale = (high - low) * shrink / maxq
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        dequantized = Grid(scale, torch.round(-low * shrink / scale), maxq).fake_quantize(rows)
        error = (dequantized - rows).abs().pow(norm).sum(1)
        better = error < best_error
        best_error[better], best[better] = error[better], dequantized[better]
    return best.reshape(w.shape)


def _hqq_slow(w: torch.Tensor, fmt: PackedFormat) -> torch.Tensor:
    """`compress.grids.hqq` with the library's slow solver swapped in for the call."""
    from hqq.core import optimize
    from hqq.core.quantize import Quantizer

    default = Quantizer.optimize_weights
    Quantizer.optimize_weights = optimize.optimize_weights_proximal_slow
    try:
        return hqq(w, fmt).dequantize()
    finally:
        Quantizer.optimize_weights = default


def _linears(model: Any) -> dict[str, nn.Linear]:
    head = model.get_output_embeddings()
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def _bf16_forward(linear: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        w, b = linear.weight.bfloat16(), None if linear.bias is None else linear.bias.bfloat16()
        return nn.functional.linear(x.bfloat16(), w, b).to(x.dtype)

    return forward


@torch.no_grad()
def apply_case(model: Any, tokenizer: Any, case: str) -> None:
    """Change `model`'s linears in place as `case` says (see the module docstring)."""
    linears = _linears(model)
    if case == "bf16-linears":
        for linear in linears.values():
            linear.forward = _bf16_forward(linear)  # type: ignore[method-assign,assignment]
    elif case == "gptq-int8":
        from catalog.data import NAMED
        from compress.calibrated import gptq_layerwise
        from compress.calibration import CalibrationParams, calibration_rows
        from compress.gptq import GPTQSettings

        params = CalibrationParams(samples=64, seq_len=512)
        calibration = calibration_rows(tokenizer, params, NAMED, 0)
        formats = dict.fromkeys(linears, PackedFormat(8, None))
        settings = GPTQSettings(sym=True, act_order=True)
        gptq_layerwise(model, calibration, params, settings, formats, lambda _: None)
    else:
        fake_quantize = _formats()[case]
        for linear in linears.values():
            linear.weight.copy_(fake_quantize(linear.weight.float()))


def measure(model_dir: Path, cases: list[str], data: list[str], windows: int, seq_len: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = {name: held_out(tokenizer, name, seq_len)[:windows] for name in data}
    results: dict[str, Any] = {}
    for case in cases:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        start = time.perf_counter()
        apply_case(model, tokenizer, case)
        results[case] = {"seconds": round(time.perf_counter() - start, 1)}
        for name, windows_of in rows.items():
            r = divergence(reference, model, windows_of, scored_bytes(tokenizer, windows_of))
            results[case][name] = r
            print(
                f"{case:13s} {name:12s} KL {r['kl_mean']:.4f} ± {r['kl_stderr']:.4f}  top-1 "
                f"{r['top1_agreement']:.1%} ± {r['top1_agreement_stderr']:.1%}  ppl "
                f"{r['perplexity']:.2f} (float32 {r['reference_perplexity']:.2f})",
                flush=True,
            )
        del model
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gemma3-270m", help="built-in name or model dir")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {CASES}")
    parser.add_argument("--data", default="corpus,shakespeare")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", default="reports/weight-error.json")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; allowed: {', '.join(CASES)}")
    model_dir = resolve_model(args.model)
    results = measure(model_dir, cases, args.data.split(","), args.windows, args.seq_len)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": str(model_dir), **results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

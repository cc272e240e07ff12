"""Our GPTQ against the reference implementation (IST-DASLab/gptq, `GPTQ.fasterquant`), on the
same layers, the same calibration inputs and the same settings.

`python benchmarks/gptq_reference.py --reference DIR [--model gemma3-270m] [--layers 0,8,17]
[--samples 32] [--seq-len 256] [--out reports/gptq-reference.json]`

DIR is a checkout of https://github.com/IST-DASLab/gptq (its `gptq.py` and `quant.py` are
imported from there; nothing of it is copied here). Model: the float model runs the calibration
windows once; every linear of the chosen layers records its inputs X. Both implementations
accumulate their Hessian from the same batches of X and quantize the same float weight (one
layer at a time, so neither sees the other's rounding). Per setting, reported over all those
linears: the share of weights whose dequantized values agree (|a - b| <= 1e-3 x the group's
scale: a group's grid fitted on columns that float noise moved differently agrees to ~1e-6 of a
step, not bit for bit), the share one step apart (float ties decided differently), and the
layer-output error ||X W^T - X Q^T||^2 / ||X W^T||^2 of each implementation and of
round-to-nearest on the same grid. The reference calls `torch.cuda.synchronize()`, a no-op
here (patched) on a CPU-only torch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from reference_check import float_model_and_rows, parser, write  # benchmarks/
from torch import nn

from compress.calibration import decoder_layers
from compress.gptq import GPTQSettings, Hessian, gptq
from compress.grids import rtn
from compress.packed import PackedFormat

SETTINGS = {
    "int4-g128 act-order static-groups": (
        PackedFormat(4, 128),
        GPTQSettings(act_order=True, static_groups=True),
    ),
    "int4-g128": (PackedFormat(4, 128), GPTQSettings()),
    "int4-g32": (PackedFormat(4, 32), GPTQSettings()),
    "int8 per channel sym act-order": (
        PackedFormat(8, None),
        GPTQSettings(act_order=True, sym=True),
    ),
}


def _inputs(model: Any, rows: torch.Tensor, layers: list[int]) -> dict[str, list[torch.Tensor]]:
    """{linear name: its input batches} over the calibration rows, float model."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for index in layers:
        for name, module in decoder_layers(model)[index].named_modules():
            if isinstance(module, nn.Linear):
                key = f"layers.{index}.{name}"
                seen[key] = []
                hooks.append(
                    module.register_forward_pre_hook(
                        lambda _m, args, key=key: seen[key].append(
                            args[0].detach().reshape(-1, args[0].shape[-1])
                        )
                    )
                )
    with torch.no_grad():
        for batch in rows.split(8):
            model(batch)
    for hook in hooks:
        hook.remove()
    return seen


def _reference(module_dir: Path) -> tuple[Any, Any]:
    sys.path.insert(0, str(module_dir))
    import gptq as ref_gptq
    import quant as ref_quant

    torch.cuda.synchronize = lambda *a, **k: None
    return ref_gptq, ref_quant


def _reference_quantize(
    ref: tuple[Any, Any],
    linear: nn.Linear,
    batches: list[torch.Tensor],
    fmt: PackedFormat,
    cfg: GPTQSettings,
) -> torch.Tensor:
    ref_gptq, ref_quant = ref
    layer = nn.Linear(linear.in_features, linear.out_features, bias=False)
    layer.weight.data = linear.weight.detach().float().clone()
    g = ref_gptq.GPTQ(layer)
    g.quantizer = ref_quant.Quantizer()
    g.quantizer.configure(fmt.bits, perchannel=True, sym=cfg.sym, mse=False)
    for x in batches:
        g.add_batch(x, None)
    g.fasterquant(
        blocksize=cfg.block_size,
        percdamp=cfg.damp,
        groupsize=fmt.group_size or -1,
        actorder=cfg.act_order,
        static_groups=cfg.static_groups,
    )
    return layer.weight.detach()


def _output_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """||X W^T - X Q^T||^2 / ||X W^T||^2 from the Hessian (2/n X^T X)."""
    d = w - q
    return float(torch.einsum("oi,ij,oj->", d, h, d) / torch.einsum("oi,ij,oj->", w, h, w))


def compare(
    model: Any, inputs: dict[str, list[torch.Tensor]], ref: tuple[Any, Any]
) -> dict[str, Any]:
    modules = dict(model.named_modules())
    prefix = next(n for n, m in modules.items() if m is decoder_layers(model))
    results: dict[str, Any] = {}
    for label, (fmt, cfg) in SETTINGS.items():
        equal = one_step = total = 0
        errors: dict[str, list[float]] = {"ours": [], "reference": [], "rtn": []}
        started = time.perf_counter()
        for key, batches in inputs.items():
            linear = modules[f"{prefix}.{key.removeprefix('layers.')}"]
            w = linear.weight.detach().float()
            hessian = Hessian(w.shape[1])
            for x in batches:
                hessian.add(x)
            ours = gptq(w, hessian.h, fmt, cfg)
            theirs = _reference_quantize(ref, linear, batches, fmt, cfg)
            scale = ours.scales.repeat_interleave(w.shape[1] // ours.scales.shape[1], dim=1)
            gap = (ours.dequantize() - theirs).abs() / scale
            equal += int((gap <= 1e-3).sum())
            one_step += int(((gap - 1).abs() <= 1e-3).sum())
            total += w.numel()
            errors["ours"].append(_output_error(w, ours.dequantize(), hessian.h))
            errors["reference"].append(_output_error(w, theirs, hessian.h))
            errors["rtn"].append(_output_error(w, rtn(w, fmt, cfg.sym).dequantize(), hessian.h))
        mean = {k: sum(v) / len(v) for k, v in errors.items()}
        results[label] = {
            "linears": len(inputs),
            "weights_equal": equal / total,
            "weights_one_step_apart": one_step / total,
            "output_error_mean": mean,
            "seconds_both": round(time.perf_counter() - started, 1),
        }
        print(
            f"{label:36s} equal {equal / total:.4%}  one step {one_step / total:.4%}  output error "
            f"ours {mean['ours']:.3e}  reference {mean['reference']:.3e}  rtn {mean['rtn']:.3e}",
            flush=True,
        )
    return results


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__, "IST-DASLab/gptq checkout", 32, "reports/gptq-reference.json")
    args = cli.parse_args(argv)
    if not (args.reference / "gptq.py").is_file() or not (args.reference / "quant.py").is_file():
        cli.error(
            f"--reference: {args.reference} holds no gptq.py and quant.py; clone IST-DASLab/gptq"
        )
    model_dir, model, rows = float_model_and_rows(args)
    inputs = _inputs(model, rows, [int(i) for i in args.layers.split(",")])
    results = compare(model, inputs, _reference(args.reference))
    write(args.out, {"model": str(model_dir), "layers": args.layers, **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

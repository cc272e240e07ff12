"""Our AWQ against the reference implementation (AutoAWQ 0.2.9's `AwqQuantizer`), on the same
decoder layers, the same calibration inputs and the same settings.

`python benchmarks/awq_reference.py --reference DIR [--model gemma3-270m] [--layers 0,8,17]
[--samples 16] [--seq-len 256] [--out reports/awq-reference.json]`

DIR is an unpacked AutoAWQ source tree (`pip download autoawq==0.2.9 --no-deps --no-binary
:all:`, then untar; the directory that holds `awq/`). Nothing of it is copied here: its
quantizer (`_get_input_feat`, `_search_best_scale`, `_search_best_clip`,
`pseudo_quantize_tensor`), its `apply_scale` / `apply_clip` and its Gemma 2 layer groups
(`Gemma2AWQForCausalLM.get_layers_for_scaling`: q/k/v after the input norm inspecting the
attention, gate/up after the pre-feed-forward norm inspecting the MLP, down after up) run as
they are. Its package `__init__`s (which import every model and the CUDA kernels) are bypassed
by registering the packages' paths; the fused-kernel modules it imports and never calls here
are empty stand-ins. AutoAWQ predates Gemma 3: its Gemma rule for folding scales into a norm
that multiplies by (1 + weight) is extended to `Gemma3RMSNorm` (without it the reference folds
the scales wrongly; ours handles every Gemma norm). On a CPU its scale search does not restore the
weights after each point of its grid: the `state_dict()` it restores from holds `.cpu()` of
the weights, on a CPU the very tensors it then scales in place (on a GPU, copies); every later
point then starts from scaled weights, and the first point always wins. The layer's
`state_dict` is made to return copies, as `.cpu()` gives on a GPU.

Model: the float model runs the calibration windows once (one batch, so that both see the
same tensors); each chosen layer is copied twice and quantized from its float inputs by each
implementation: scales, folding, clipping, then 4-bit asymmetric round-to-nearest in groups of
128. Reported per layer: how many of its norms and linears agree after scaling and clipping
(the same scales and clips chosen), the share of quantized weights equal
(|a - b| <= 1e-3 x the group's step), and the layer-output error ||y_q - y||^2 / ||y||^2 on
the calibration inputs for ours, the reference, and plain round-to-nearest of the float layer.
"""

from __future__ import annotations

import copy
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch
from reference_check import float_model_and_rows, parser, write  # benchmarks/
from torch import nn

from compress.awq import AWQSettings, apply_awq
from compress.calibration import Batch, run_layerwise
from compress.grids import rtn
from compress.packed import PackedFormat

FORMAT = PackedFormat(4, 128)
STAND_INS = (
    "awq.modules.linear",
    "awq.models.base",
    "awq.utils.fused_utils",
    "awq.modules.fused",
    "awq.modules.fused.block",
    "awq.modules.fused.model",
    "awq.modules.fused.norm",
)


class _StandIn(types.ModuleType):
    """A module whose every name is an empty class: imported by AutoAWQ, never called here."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def _reference(source: Path) -> types.SimpleNamespace:
    for name in ("awq", "awq.models", "awq.modules"):
        package = types.ModuleType(name)
        package.__path__ = [str(source.joinpath(*name.split(".")))]
        sys.modules[name] = package
    for name in STAND_INS:
        sys.modules[name] = _StandIn(name)
    from awq.models.gemma2 import Gemma2AWQForCausalLM
    from awq.quantize import scale
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.module import get_named_linears
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    scale.Gemma2RMSNorm = (scale.Gemma2RMSNorm, Gemma3RMSNorm)
    return types.SimpleNamespace(
        quantizer=AwqQuantizer,
        groups=Gemma2AWQForCausalLM.get_layers_for_scaling,
        apply_scale=scale.apply_scale,
        apply_clip=scale.apply_clip,
        named_linears=get_named_linears,
    )


def _reference_quantizer(ref: types.SimpleNamespace, batch: Batch) -> Any:
    """An `AwqQuantizer` set up as its constructor would for 4-bit g128 with zero points,
    without loading a model or calibration data of its own."""
    q = ref.quantizer.__new__(ref.quantizer)
    q.w_bit, q.group_size, q.zero_point = FORMAT.bits, FORMAT.group_size, True
    q.duo_scaling, q.apply_clip, q.export_compatible = True, True, True
    q.max_chunk_memory, q.n_parallel_calib_samples = 1024**3, None
    q.awq_model = types.SimpleNamespace(model_type="gemma3_text")
    q.inps, q.module_kwargs = batch[0], dict(batch[1])
    return q


def _copying_state_dict(module: nn.Module) -> Any:
    def state_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return {k: v.clone() for k, v in nn.Module.state_dict(module, *args, **kwargs).items()}

    return state_dict


@torch.no_grad()
def reference_awq(
    ref: types.SimpleNamespace, layer: nn.Module, batch: Batch
) -> dict[str, torch.Tensor]:
    """AutoAWQ's `quantize()` body for one layer: input features, scales, clips, then its
    fake quantization (in place); returns the scaled and clipped float weights."""
    q = _reference_quantizer(ref, batch)
    linears = ref.named_linears(layer)
    features = q._get_input_feat(layer, linears)
    for module in layer.modules():  # see the module doc: what the search restores from
        module.state_dict = _copying_state_dict(module)  # type: ignore[method-assign]
    scales = [
        q._search_best_scale(layer, **g) for g in ref.groups(layer, features, q.module_kwargs)
    ]
    ref.apply_scale(layer, scales, input_feat_dict=features)
    ref.apply_clip(layer, q._search_best_clip(layer, linears, features))
    scaled = {n: m.weight.detach().clone() for n, m in linears.items()}
    for linear in linears.values():
        linear.weight.copy_(q.pseudo_quantize_tensor(linear.weight.data)[0])
    return scaled


@torch.no_grad()
def round_to_nearest(layer: nn.Module) -> None:
    """Every linear of `layer` replaced by its 4-bit g128 round-to-nearest values."""
    for m in layer.modules():
        if isinstance(m, nn.Linear):
            m.weight.copy_(rtn(m.weight, FORMAT).dequantize())


@torch.no_grad()
def our_awq(layer: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    apply_awq(layer, [batch], FORMAT, AWQSettings())
    scaled = {n: w.clone() for n, w in _linears(layer).items()}
    round_to_nearest(layer)
    return scaled


def _float_layer_inputs(model: Any, rows: torch.Tensor, layers: list[int]) -> dict[int, Batch]:
    seen: dict[int, Batch] = {}

    def visit(index: int, _layer: nn.Module, batches: list[Batch]) -> None:
        if index in layers:
            seen[index] = batches[0]

    run_layerwise(model, rows, len(rows), visit)
    return seen


def _output(layer: nn.Module, batch: Batch) -> torch.Tensor:
    out = layer(batch[0], **batch[1])
    return out[0] if isinstance(out, tuple) else out


def _linears(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach() for n, m in layer.named_modules() if isinstance(m, nn.Linear)}


def compare_layer(ref: types.SimpleNamespace, layer: nn.Module, batch: Batch) -> dict[str, Any]:
    started = time.perf_counter()
    ours, theirs, plain = copy.deepcopy(layer), copy.deepcopy(layer), copy.deepcopy(layer)
    our_scaled = our_awq(ours, batch)
    ours_s = time.perf_counter() - started
    their_scaled = reference_awq(ref, theirs, batch)
    theirs_s = time.perf_counter() - started - ours_s
    round_to_nearest(plain)
    equal = total = 0
    their_weights = _linears(theirs)
    for name, a in _linears(ours).items():
        b = their_weights[name]
        step = rtn(a, FORMAT).scales.repeat_interleave(FORMAT.group_size or 1, dim=1)
        equal += int(((a - b).abs() <= 1e-3 * step).sum())
        total += a.numel()
    norms = dict(theirs.named_parameters())
    same = [
        torch.allclose(p, norms[n], rtol=1e-5, atol=1e-6)
        for n, p in ours.named_parameters()
        if "norm" in n
    ] + [torch.allclose(w, their_scaled[n], rtol=1e-4, atol=1e-6) for n, w in our_scaled.items()]
    with torch.no_grad():
        y = _output(layer, batch)
        error = {
            k: float((_output(m, batch) - y).pow(2).sum() / y.pow(2).sum())
            for k, m in (("ours", ours), ("reference", theirs), ("rtn", plain))
        }
    return {
        "scaled_clipped_equal": f"{sum(same)}/{len(same)}",
        "weights_equal": equal / total,
        "output_error": error,
        "seconds": {"ours": round(ours_s, 1), "reference": round(theirs_s, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    cli = parser(__doc__, "AutoAWQ source tree", 16, "reports/awq-reference.json")
    args = cli.parse_args(argv)
    if not (args.reference / "awq" / "quantize" / "quantizer.py").is_file():
        cli.error(
            f"--reference: {args.reference} holds no awq/quantize/quantizer.py; unpack the "
            "autoawq 0.2.9 sdist and pass the directory that holds awq/"
        )
    ref = _reference(args.reference)
    model_dir, model, rows = float_model_and_rows(args)
    indices = [int(i) for i in args.layers.split(",")]
    inputs = _float_layer_inputs(model, rows, indices)
    results: dict[str, Any] = {}
    for index in indices:
        results[str(index)] = r = compare_layer(ref, model.model.layers[index], inputs[index])
        e = r["output_error"]
        print(
            f"layer {index:2d}  norms and scaled linears equal {r['scaled_clipped_equal']}  "
            f"weights equal {r['weights_equal']:.4%}  output error ours {e['ours']:.3e}  "
            f"reference {e['reference']:.3e}  rtn {e['rtn']:.3e}  ({r['seconds']})",
            flush=True,
        )
    write(args.out, {"model": str(model_dir), "format": "int4-g128 asym", **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

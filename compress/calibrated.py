"""Packed quantization methods as `quantize` params: rtn, gptq, awq, hqq (and `mixed`, in
`compress.mixed`), each writing a `packed` artifact (`compress.packed_io`).

Model: load the input in float32, pick the linears (`targets` minus `ignore`), then
- rtn / hqq: each weight alone (no calibration data);
- gptq: `run_layerwise` over calibration windows, a Hessian per linear from its inputs, GPTQ on
  each weight, the layer's weights replaced by their quantized values before the next layer;
- awq: `run_layerwise` with AWQ's scales and clipping applied to each layer (the float function
  unchanged by the scales), then rtn or gptq (`then`) on the scaled model.
Embeddings (and a tied lm_head) are their own choice: `keep`, `int8` per row (symmetric), or
`int4` in groups (GPTQ's asymmetric grid; `int4` is groups of 32, `int4-g64` .. of others).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator
from torch import nn

from compress.awq import AWQSettings, apply_awq
from compress.calibration import (
    Batch,
    Calibration,
    CalibrationParams,
    calibration_rows,
    layer_prefix,
    run_layerwise,
    run_with_input_hooks,
)
from compress.data import check_data_in_context
from compress.gptq import GPTQSettings, Hessian, check_settings, gptq
from compress.grids import hqq, rtn
from compress.packed import GROUP_SIZES, PackedFormat, Quantized
from compress.packed_io import PackedModel
from compress.registry import StepContext, StepError, StepParams

Embeddings = Literal["keep", "int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g256"]


def embedding_format(embeddings: Embeddings) -> PackedFormat | None:
    """The packed format an `embeddings` setting names (None: kept in float)."""
    if embeddings == "keep":
        return None
    return PackedFormat.parse("int4-g32" if embeddings == "int4" else embeddings)


class CheckedCalibration(CalibrationParams):
    @field_validator("data")
    @classmethod
    def _data_exists(cls, value: str, info: ValidationInfo) -> str:
        return check_data_in_context(value, info.context)


class PackedParams(StepParams):
    """What every packed method shares."""

    bits: Literal[4, 8] = 4
    group_size: Literal[32, 64, 128, 256] | None = 128
    """Input features per scale and zero point. 4-bit: required (128 when absent). 8-bit: per
    output channel when absent or null (torch's int8 kernel, bfloat16 compute on the CPU); a
    group size stores Q8_0-like groups, dequantized per call (float32 compute: more accurate,
    slower)."""
    embeddings: Embeddings = "keep"
    """The input embedding (and a tied lm_head): kept in float, int8 per row, or int4 in groups
    (`int4`: of 32)."""
    targets: list[str] | None = None
    """Linear layers to quantize, by name or `re:` regex; all of the decoder's when absent."""
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    """Linear layers to keep in float."""

    @model_validator(mode="before")
    @classmethod
    def _per_channel_int8_by_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("bits") == 8 and "group_size" not in data:
            return {**data, "group_size": None}
        return data

    @model_validator(mode="after")
    def _format_fits(self) -> PackedParams:
        if self.bits == 4 and self.group_size is None:
            raise ValueError(f"group_size: 4-bit needs one of {list(GROUP_SIZES)}")
        return self

    @property
    def format(self) -> PackedFormat:
        return PackedFormat(self.bits, self.group_size)

    def record(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class RTNParams(PackedParams):
    method: Literal["rtn"]
    """Round-to-nearest on GPTQ's asymmetric grid (the baseline of the calibrated methods)."""
    sym: bool = False


class HQQParams(PackedParams):
    method: Literal["hqq"]
    """Half-quadratic quantization: calibration-free, fits a float zero point per group."""


class GPTQParams(PackedParams):
    method: Literal["gptq"]
    damp: float = Field(default=0.01, gt=0, le=1)
    """Added to the Hessian's diagonal, as a fraction of its mean."""
    act_order: bool = False
    """Quantize columns by decreasing activation energy (needs static_groups with groups)."""
    static_groups: bool = False
    """Fit every group's grid before any column moves."""
    sym: bool = False
    block_size: int = Field(default=128, ge=1, le=4096)
    calibration: CheckedCalibration = Field(default_factory=lambda: CheckedCalibration())

    @model_validator(mode="after")
    def _order_fits(self) -> GPTQParams:
        problem = check_settings(self.format, self.settings)
        if problem:
            raise ValueError(f"act_order: {problem}")
        return self

    @property
    def settings(self) -> GPTQSettings:
        return GPTQSettings(
            self.damp, self.block_size, self.act_order, self.static_groups, self.sym
        )


class AWQParams(PackedParams):
    method: Literal["awq"]
    then: Literal["rtn", "gptq"] = "rtn"
    """How the scaled weights are quantized."""
    grid: int = Field(default=20, ge=2, le=100)
    clip: bool = True
    """Search a clipping of each linear's largest weights (not q/k) after scaling."""
    calibration: CheckedCalibration = Field(default_factory=lambda: CheckedCalibration())


Calibrated = RTNParams | HQQParams | GPTQParams | AWQParams


def quantized_linears(model: nn.Module, chosen: set[str]) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if n in chosen and isinstance(m, nn.Linear)}


def quantize_embeddings(
    model: Any, embeddings: Embeddings
) -> tuple[PackedFormat, Quantized] | None:
    """The input embedding's codes as `embeddings` says (int8: symmetric per row; int4: the
    asymmetric grid per group), its float weight (a tied head's too) replaced by their values
    so that calibration and measurement see the built model. Its shape was checked
    (`check_embeddings`) before the model was loaded."""
    fmt = embedding_format(embeddings)
    if fmt is None:
        return None
    weight = model.get_input_embeddings().weight.detach().float()
    codes = rtn(weight, fmt, sym=fmt.bits == 8)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(codes.dequantize())
    return fmt, codes


def calibrate(
    model: Any, tokenizer: Any, params: GPTQParams | AWQParams, ctx: StepContext
) -> Calibration:
    try:
        return calibration_rows(tokenizer, params.calibration, ctx.data, ctx.seed)
    except ValueError as e:
        raise StepError(f"calibration: {e}") from None


def quantize_packed(
    model: Any,
    tokenizer: Any,
    params: Calibrated,
    chosen: set[str],
    ctx: StepContext,
    progress: Any,
) -> tuple[PackedModel, dict[str, Any]]:
    """The model's chosen linears packed by `params.method` (the model's float weights are
    changed in place: scaled by AWQ, replaced by their quantized values for GPTQ)."""
    fmt, info = params.format, params.record()
    embeddings = quantize_embeddings(model, params.embeddings)  # first: calibration sees it
    modules: dict[str, tuple[PackedFormat, Quantized]] = {}
    if isinstance(params, RTNParams | HQQParams):
        for name, linear in quantized_linears(model, chosen).items():
            w = linear.weight.detach()
            modules[name] = (
                fmt,
                rtn(w, fmt, params.sym) if isinstance(params, RTNParams) else hqq(w, fmt),
            )
            progress(name)
    else:
        calibration = calibrate(model, tokenizer, params, ctx)
        info["calibration"] = calibration.record(params.calibration)
        if isinstance(params, AWQParams):
            info["awq_scale_ratios"] = _awq(model, calibration, params, progress)
        if isinstance(params, GPTQParams) or params.then == "gptq":
            settings = params.settings if isinstance(params, GPTQParams) else GPTQSettings()
            formats = dict.fromkeys(chosen, fmt)
            modules = gptq_layerwise(
                model, calibration, params.calibration, settings, formats, progress
            )
        else:
            modules = {
                n: (fmt, rtn(m.weight.detach(), fmt))
                for n, m in quantized_linears(model, chosen).items()
            }
    return PackedModel(model, modules, embeddings), info


def _awq(model: Any, calibration: Calibration, params: AWQParams, progress: Any) -> dict[str, Any]:
    cfg = AWQSettings(grid=params.grid, clip=params.clip)
    ratios: dict[str, Any] = {}

    def visit(index: int, layer: nn.Module, batches: list[Batch]) -> None:
        ratios[str(index)] = apply_awq(layer, batches, params.format, cfg)
        progress(f"awq layer {index}")

    run_layerwise(model, calibration.rows, params.calibration.batch_size, visit)
    return ratios


def gptq_layerwise(
    model: Any,
    calibration: Calibration,
    params: CalibrationParams,
    settings: GPTQSettings,
    formats: dict[str, PackedFormat],
    progress: Any,
) -> dict[str, tuple[PackedFormat, Quantized]]:
    """GPTQ on every linear named in `formats`, to its format, layer by layer."""
    modules: dict[str, tuple[PackedFormat, Quantized]] = {}

    def visit(index: int, layer: nn.Module, batches: list[Batch]) -> None:
        prefix = layer_prefix(model, layer)
        linears = {
            n: m
            for n, m in layer.named_modules()
            if isinstance(m, nn.Linear) and f"{prefix}.{n}" in formats
        }
        hessians = {n: Hessian(m.in_features) for n, m in linears.items()}
        run_with_input_hooks(layer, batches, {n: h.add for n, h in hessians.items()})
        for n, m in linears.items():
            fmt = formats[f"{prefix}.{n}"]
            qw = gptq(m.weight, hessians[n].h, fmt, settings)
            m.weight.copy_(qw.dequantize().to(m.weight.dtype))
            modules[f"{prefix}.{n}"] = (fmt, qw)
            progress(f"{prefix}.{n}")

    run_layerwise(model, calibration.rows, params.batch_size, visit)
    return modules


def check_embeddings(model: Any, embeddings: Embeddings) -> None:
    """int4 rows need a hidden size divisible by the group size and a vocabulary by 16 (the
    int4 kernel's row blocks, which a tied head runs through)."""
    fmt = embedding_format(embeddings)
    if fmt is None or fmt.bits != 4:
        return
    assert fmt.group_size is not None
    vocab, hidden = model.get_input_embeddings().weight.shape
    if hidden % fmt.group_size:
        raise StepError(
            f"embeddings: {embeddings} needs a hidden size divisible by {fmt.group_size} (this "
            f"model's is {hidden}); use int4-g32, or int8"
        )
    if vocab % 16:
        raise StepError(
            f"embeddings: int4 needs a vocabulary divisible by 16 (the int4 kernel's row "
            f"blocks; this model's is {vocab}); use int8"
        )


def check_shapes(model: nn.Module, names: list[str], fmt: PackedFormat) -> None:
    """The int4 kernel needs out_features divisible by 16 and in_features by the group size."""
    modules = dict(model.named_modules())
    size = fmt.group_size or 1
    odd = [
        n
        for n in names
        if modules[n].in_features % size or (fmt.bits == 4 and modules[n].out_features % 16)
    ]
    if odd:
        m = modules[odd[0]]
        raise StepError(
            f"{fmt.name} needs in_features divisible by {size} and out_features by 16; "
            f"{len(odd)} layers are not (e.g. {odd[0]}: {m.in_features} -> {m.out_features}); "
            "lower group_size or add them to ignore"
        )

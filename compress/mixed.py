"""Mixed precision to a budget: a format per part, chosen to minimise the summed sensitivity.

Model: each part (`compress.sensitivity`) can take any candidate format (or stay float with
`keep`); its cost is the bytes it stores (codes, and float32 scales and zero points per group or
row), its loss the KL its scan measured. The plan is the exact minimum of summed KL under the
budget, a multiple-choice knapsack solved by dynamic programming over the budget cut into
20,000 units, each part's cost rounded up to whole units (so the plan never exceeds the budget).
The budget is bits per weight over the planned linears, or a size in bytes of the whole
model's weights (embeddings and everything kept in float included). The plan is then built
(each part quantized by `quantizer`), and the KL of the whole quantized model measured on the
scan's windows beside the predicted sum.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from compress.calibrated import (
    CheckedCalibration,
    Embeddings,
    embedding_format,
    gptq_layerwise,
    quantize_embeddings,
)
from compress.calibration import calibration_rows
from compress.gptq import GPTQSettings
from compress.grids import hqq, rtn
from compress.packed import PackedFormat, Quantized
from compress.packed_io import PackedModel
from compress.registry import StepContext, StepError, StepParams
from compress.sensitivity import Part, kl, parts_of, run_from, scan

UNITS = 20_000
KEEP = "keep"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)\s*$")
_FACTORS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    bits_per_weight: float | None = Field(default=None, gt=0, le=32)
    """Average stored bits per weight over the planned linears."""
    size: str | None = None
    """Bytes of all the model's weights, e.g. `150MB` or `140MiB`."""

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None and not _SIZE.match(value):
            raise ValueError(f"found {value!r}; write a number and a unit: 150MB, 140MiB, 1GB")
        return value

    @model_validator(mode="after")
    def _one(self) -> Budget:
        if (self.bits_per_weight is None) == (self.size is None):
            raise ValueError("give exactly one of bits_per_weight or size")
        return self

    def size_bytes(self) -> int | None:
        if self.size is None:
            return None
        number, unit = _SIZE.match(self.size).groups()  # type: ignore[union-attr]
        return int(float(number) * _FACTORS[unit])


class MixedParams(StepParams):
    method: Literal["mixed"]
    budget: Budget
    candidates: list[str] = Field(default_factory=lambda: ["int4-g128", "int4-g32", "int8"])
    """Formats a part may take (int8, int4-g32 .. int4-g256, keep)."""
    quantizer: Literal["rtn", "hqq", "gptq"] = "gptq"
    """How each part is quantized to its format when the plan is built (the scan uses rtn for
    gptq, as GPTQ's gain needs the layer's calibration inputs)."""
    embeddings: Embeddings = "keep"
    targets: list[str] | None = None
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    scan: CheckedCalibration = Field(
        default_factory=lambda: CheckedCalibration(samples=4, seq_len=128, batch_size=4)
    )
    """Windows the sensitivity scan and the measured KL use (the data's train split, drawn
    apart from the calibration windows; evals read the validation split)."""
    calibration: CheckedCalibration = Field(default_factory=lambda: CheckedCalibration())
    """GPTQ's calibration windows (quantizer: gptq)."""

    @field_validator("candidates")
    @classmethod
    def _formats(cls, value: list[str]) -> list[str]:
        for name in value:
            if name != KEEP:
                PackedFormat.parse(name)
        if len(set(value)) != len(value) or not value:
            raise ValueError("list each candidate format once, at least one")
        return value


def part_bytes(part: Part, fmt_name: str, columns: dict[str, tuple[int, int]]) -> int:
    """Stored bytes of a part in a format: codes, and 8 bytes (scale, zero) per group or row."""
    total = 0
    for name in part.linears:
        rows, cols = columns[name]
        if fmt_name == KEEP:
            total += rows * cols * 4
            continue
        fmt = PackedFormat.parse(fmt_name)
        groups = cols // fmt.group_size if fmt.group_size else 1
        total += rows * cols * fmt.bits // 8 + rows * groups * 8
    return total


def plan(
    parts: list[Part],
    losses: dict[str, dict[str, float]],
    costs: dict[str, dict[str, int]],
    budget: int,
) -> dict[str, str]:
    """The format per part minimising summed loss with summed cost <= budget (exact knapsack on
    costs rounded up to budget / UNITS); StepError when even the cheapest choice does not fit."""
    unit = max(1, math.ceil(budget / UNITS))
    capacity = budget // unit
    best = np.zeros(capacity + 1)
    choices: list[np.ndarray] = []
    for part in parts:
        options = list(losses[part.name])
        nxt = np.full(capacity + 1, np.inf)
        pick = np.full(capacity + 1, -1, dtype=np.int16)
        for i, name in enumerate(options):
            c = math.ceil(costs[part.name][name] / unit)
            if c > capacity:
                continue
            shifted = np.full(capacity + 1, np.inf)
            shifted[c:] = best[: capacity + 1 - c] + losses[part.name][name]
            better = shifted < nxt
            nxt[better], pick[better] = shifted[better], i
        best = nxt
        choices.append(pick)
    if not np.isfinite(best[capacity]):
        cheapest = sum(min(costs[p.name].values()) for p in parts)
        raise StepError(
            f"budget: {budget:,} bytes cannot hold the planned parts even at their cheapest "
            f"formats ({cheapest:,} bytes); raise the budget or add a smaller candidate"
        )
    chosen: dict[str, str] = {}
    c = capacity
    for part, pick in zip(reversed(parts), reversed(choices)):
        name = list(losses[part.name])[int(pick[c])]
        chosen[part.name] = name
        c -= math.ceil(costs[part.name][name] / unit)
    return {p.name: chosen[p.name] for p in parts}


def _budget_bytes(params: MixedParams, model: Any, parts: list[Part], planned: set[str]) -> int:
    """Bytes the planned parts may take: bits per weight x their weights, or the size budget
    less what everything else stores (embeddings as `embeddings` says, the rest in float32)."""
    if params.budget.bits_per_weight is not None:
        return int(params.budget.bits_per_weight * sum(p.params for p in parts) / 8)
    embed = model.get_input_embeddings().weight
    other = 0
    fmt = embedding_format(params.embeddings)
    for name, tensor in model.named_parameters(remove_duplicate=True):
        if name.removesuffix(".weight") in planned:
            continue
        if tensor is embed and fmt is not None:
            other += math.ceil(tensor.numel() * fmt.bits_per_weight() / 8) + (
                0 if fmt.group_size else tensor.shape[0] * 8
            )
        else:
            other += tensor.numel() * 4
    left = (params.budget.size_bytes() or 0) - other
    if left <= 0:
        raise StepError(
            f"budget.size: {params.budget.size} is less than the {other:,} bytes of the weights "
            "outside the plan (embeddings, norms, ignored linears); raise it, or set "
            "embeddings: int8 (or int4)"
        )
    return left


def quantize_mixed(
    model: Any,
    tokenizer: Any,
    params: MixedParams,
    chosen: set[str],
    ctx: StepContext,
    progress: Any,
) -> tuple[PackedModel, dict[str, Any]]:
    embeddings = quantize_embeddings(model, params.embeddings)  # first: the scan sees it
    parts = parts_of(model, chosen)
    planned = {n for p in parts for n in p.linears}
    modules = dict(model.named_modules())
    columns = {n: tuple(modules[n].weight.shape) for n in planned}
    try:
        # NOTE: train-split windows (seeded apart from calibration's): the report measures
        # divergence on the validation split, which the plan must not be chosen on
        windows = calibration_rows(tokenizer, params.scan, ctx.data, ctx.seed + 1)
    except ValueError as e:
        raise StepError(f"scan: {e}") from None
    candidates = [PackedFormat.parse(c) for c in params.candidates if c != KEEP]
    scan_quantizer = hqq if params.quantizer == "hqq" else rtn
    losses, reference, inputs = scan(
        model, windows.rows, parts, candidates, scan_quantizer, progress, params.scan.batch_size
    )
    if KEEP in params.candidates:
        for p in parts:
            losses[p.name][KEEP] = 0.0
    costs = {p.name: {f: part_bytes(p, f, columns) for f in losses[p.name]} for p in parts}
    budget = _budget_bytes(params, model, parts, planned)
    chosen_plan = plan(parts, losses, costs, budget)
    formats = {
        n: PackedFormat.parse(f)
        for p in parts
        if (f := chosen_plan[p.name]) != KEEP
        for n in p.linears
    }
    packed = _build(model, tokenizer, params, formats, ctx, progress)
    planned_bytes = sum(costs[p.name][chosen_plan[p.name]] for p in parts)
    info = {
        **params.model_dump(mode="json"),
        "plan": chosen_plan,
        "sensitivity": losses,
        "scan_windows": windows.record(params.scan),
        "budget_bytes": budget,
        "planned_bytes": planned_bytes,
        "planned_bits_per_weight": round(8 * planned_bytes / sum(p.params for p in parts), 4),
        "predicted_kl": sum(losses[p.name][chosen_plan[p.name]] for p in parts),
        "measured_kl": kl(reference, run_from(model, 0, inputs)),
    }
    return PackedModel(model, packed, embeddings), info


def _build(
    model: Any,
    tokenizer: Any,
    params: MixedParams,
    formats: dict[str, PackedFormat],
    ctx: StepContext,
    progress: Any,
) -> dict[str, tuple[PackedFormat, Quantized]]:
    """Each planned linear quantized to its format; the model's weights replaced by the
    quantized values (so the measured KL is the built model's)."""
    if params.quantizer == "gptq":
        try:
            calibration = calibration_rows(tokenizer, params.calibration, ctx.data, ctx.seed)
        except ValueError as e:
            raise StepError(f"calibration: {e}") from None
        return gptq_layerwise(
            model, calibration, params.calibration, GPTQSettings(), formats, progress
        )
    quantize = hqq if params.quantizer == "hqq" else rtn
    modules = dict(model.named_modules())
    built: dict[str, tuple[PackedFormat, Quantized]] = {}
    for name, fmt in formats.items():
        qw = quantize(modules[name].weight.detach(), fmt)
        modules[name].weight.copy_(qw.dequantize())
        built[name] = (fmt, qw)
        progress(name)
    return built

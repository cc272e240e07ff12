"""The quantize step: bitsandbytes int8 / nf4 / fp4, torchao int8 / int4 weight-only, and the
packed methods (rtn, gptq, awq, hqq, mixed: `compress.calibrated`, `compress.mixed`).

Model: the input model is loaded with a quantization config that names which linear layers to
quantize (`targets`, all linear layers by default, minus `ignore`); the quantized model is
written with `save_pretrained`, so transformers (and the engine) load it again from its
`config.json` alone. bitsandbytes methods go through `BitsAndBytesConfig`; `int8-wo` through
torchao's int8 weight-only config (per-channel int8 weights, activations kept in float). The
packed methods write codes, scales and zero points that `compress.load_model.load_model` serves
with torch's int4 / int8 kernels. `method` selects the params model (a tagged union).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Annotated, Any, Literal

import torch
from pydantic import Field

from compress.artifact import Artifact, copy_side_files
from compress.calibrated import Calibrated, check_embeddings, check_shapes, quantize_packed
from compress.load_spec import LOAD_QUANTIZATION, NO_HUB_KERNELS
from compress.mixed import MixedParams, quantize_mixed
from compress.registry import Step, StepContext, StepError, StepParams, register
from compress.targets import select

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LibraryParams(StepParams):
    method: Literal["bnb-int8", "bnb-nf4", "bnb-fp4", "int8-wo", "int4-wo"]
    """bnb-int8: LLM.int8 (outlier columns in float); bnb-nf4 / bnb-fp4: 4-bit blocks;
    int8-wo: int8 weight-only (torchao); int4-wo: int4 weight-only in groups, bfloat16
    activations, torchao's CPU tensor (the fast one on the CPU:
    docs/measured/quantized-kernels.md#undated-serving-speed-of-quantized-variants), stored in
    bfloat16 and quantized when loaded."""
    group_size: Literal[32, 64, 128, 256] = 32
    """int4-wo only: input features per scale / zero point."""
    double_quant: bool = False
    """4-bit only: quantize the block scales too (saves ~0.4 bits per weight)."""
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """4-bit only: dtype of the matmul after dequantization."""
    threshold: float = Field(default=6.0, ge=0)
    """bnb-int8 only: activations above this magnitude go through the float path (outliers);
    0: none do, every input is int8 per token (W8A8: exports to compressed-tensors for vLLM)."""
    targets: list[str] | None = None
    """Linear layers to quantize, by name or `re:` regex; all of them when absent."""
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"])
    """Linear layers to keep in full precision."""


QuantizeParams = Annotated[LibraryParams | Calibrated | MixedParams, Field(discriminator="method")]
PACKED_METHODS = ("rtn", "gptq", "awq", "hqq", "mixed")


def linear_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


@register
class Quantize(Step):
    name = "quantize"
    Params = QuantizeParams  # type: ignore[assignment]  # a tagged union of params models
    params: Any

    def check(self, artifact: Artifact | None, module_names: list[str] | None) -> None:
        if artifact is not None and artifact.quantization:
            raise StepError(
                f"the input is already quantized ({artifact.quantization}); quantize a full-precision model"
            )
        if self.params.targets:
            select(module_names, self.params.targets, "quantize.targets")
        if self.params.ignore != ["lm_head"]:  # a custom ignore list must name real modules
            select(module_names, self.params.ignore, "quantize.ignore")

    def planned_output(self, artifact: Artifact) -> Artifact:
        return dataclasses.replace(artifact, quantization=self.params.method)

    def _skipped(self, names: list[str]) -> list[str]:
        chosen = select(names, self.params.targets) if self.params.targets else names
        kept = (
            set(select(names, self.params.ignore, "quantize.ignore"))
            if self.params.ignore
            else set()
        )
        return sorted(n for n in names if n not in chosen or n in kept)

    def _config(self, skipped: list[str]) -> object:
        p = self.params
        if p.method == "int8-wo":
            from torchao.quantization import Int8WeightOnlyConfig
            from transformers import TorchAoConfig

            return TorchAoConfig(Int8WeightOnlyConfig(), modules_to_not_convert=skipped)
        from transformers import BitsAndBytesConfig

        if p.method == "bnb-int8":
            return BitsAndBytesConfig(
                load_in_8bit=True, llm_int8_threshold=p.threshold, llm_int8_skip_modules=skipped
            )
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=p.method.removeprefix("bnb-"),
            bnb_4bit_use_double_quant=p.double_quant,
            bnb_4bit_compute_dtype=_DTYPES[p.compute_dtype],
            llm_int8_skip_modules=skipped,
        )

    def _apply_int4_at_load(
        self, artifact: Artifact, ctx: StepContext, skipped: list[str]
    ) -> Artifact:
        """int4-wo: bfloat16 weights plus the metadata that quantizes them at load time."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(artifact.path, dtype=torch.bfloat16)
        model.save_pretrained(ctx.out_dir, safe_serialization=True)
        copy_side_files(artifact.path, ctx.out_dir)
        meta = {"method": "int4-wo", "group_size": self.params.group_size, "skip": skipped}
        (ctx.out_dir / LOAD_QUANTIZATION).write_text(json.dumps(meta, indent=2) + "\n")
        return Artifact(
            ctx.out_dir, "model", {"full_precision_linear_layers": skipped}, quantization="int4-wo"
        )

    def apply(self, artifact: Artifact, ctx: StepContext) -> Artifact:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(artifact.path)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        names = linear_names(meta)
        skipped = self._skipped(names)
        if self.params.method in PACKED_METHODS:
            return apply_packed(
                self.params, artifact, ctx, meta, [n for n in names if n not in skipped]
            )
        if self.params.method in ("bnb-nf4", "bnb-fp4") and ctx.device == "cpu":
            _check_4bit_cpu_shapes(meta, [n for n in names if n not in skipped])
        if self.params.method == "int4-wo":
            _check_group_shapes(
                meta, [n for n in names if n not in skipped], self.params.group_size
            )
            return self._apply_int4_at_load(artifact, ctx, skipped)
        model = AutoModelForCausalLM.from_pretrained(
            artifact.path,
            quantization_config=self._config(skipped),
            device_map=ctx.device,
            dtype=torch.float32,
            **NO_HUB_KERNELS,
        )
        model.save_pretrained(ctx.out_dir, safe_serialization=True)
        copy_side_files(artifact.path, ctx.out_dir)
        quantized = len(names) - len(skipped)
        return Artifact(
            ctx.out_dir,
            "model",
            {"quantized_linear_layers": quantized, "full_precision_linear_layers": skipped},
            quantization=self.params.method,
        )


def _check_4bit_cpu_shapes(model: torch.nn.Module, names: list[str]) -> None:
    """bitsandbytes' 4-bit CPU kernels pack weights in blocks of 64 input features."""
    modules = dict(model.named_modules())
    odd = [n for n in names if modules[n].in_features % 64]
    if odd:
        raise StepError(
            f"bitsandbytes 4-bit on the CPU needs in_features divisible by 64; {len(odd)} layers "
            f"are not (e.g. {odd[0]}: {modules[odd[0]].in_features}); add them to quantize.ignore"
        )


def _check_group_shapes(model: torch.nn.Module, names: list[str], group_size: int) -> None:
    modules = dict(model.named_modules())
    odd = [n for n in names if modules[n].in_features % group_size]
    if odd:
        raise StepError(
            f"int4-wo needs in_features divisible by group_size {group_size}; {len(odd)} layers "
            f"are not (e.g. {odd[0]}: {modules[odd[0]].in_features}); lower group_size or add them to ignore"
        )


def apply_packed(
    params: Any, artifact: Artifact, ctx: StepContext, meta: Any, chosen: list[str]
) -> Artifact:
    """A packed method on the chosen linears of `artifact`, written into `ctx.out_dir`."""
    from rich.progress import Progress
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.packed_io import save_packed

    if not isinstance(params, MixedParams):
        check_shapes(meta, chosen, params.format)
    check_embeddings(meta, params.embeddings)
    model = AutoModelForCausalLM.from_pretrained(artifact.path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(artifact.path)
    started = time.perf_counter()
    with Progress(transient=True) as bar:
        task = bar.add_task(f"quantize: {params.method}", total=None)

        def progress(what: str) -> None:
            bar.update(task, advance=1, description=f"quantize ({params.method}): {what}")

        with torch.no_grad():
            if isinstance(params, MixedParams):
                packed, info = quantize_mixed(model, tokenizer, params, set(chosen), ctx, progress)
            else:
                packed, info = quantize_packed(model, tokenizer, params, set(chosen), ctx, progress)
    info["quantize_seconds"] = round(time.perf_counter() - started, 1)
    save_packed(packed, ctx.out_dir, {"method": params.method})
    copy_side_files(artifact.path, ctx.out_dir)
    info["full_precision_linear_layers"] = sorted(set(linear_names(meta)) - set(packed.modules))
    return Artifact(ctx.out_dir, "model", info, quantization=params.method)

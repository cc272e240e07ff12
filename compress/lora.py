"""The lora step (PEFT LoRA; QLoRA on a quantized input) and the merge step.

Model: the input model is frozen and LoRA matrices are added to the target linear layers
(`W x + (B A x) * alpha / r`, or `alpha / sqrt(r)` with rsLoRA); only A and B train, on the
`data` set's train split. On a bitsandbytes-quantized input the model is first prepared for
k-bit training (QLoRA). The output is a PEFT adapter directory (safetensors) whose manifest names
the input as its base. `merge` folds an adapter into a full-precision copy of its base.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator

from compress.artifact import Artifact, copy_side_files
from compress.data import NO_DATA, DataCatalog, check_data_in_context, load_texts, token_rows
from compress.load_spec import NO_HUB_KERNELS
from compress.registry import Step, StepContext, StepError, StepParams, register
from compress.targets import as_peft_regex, select
from compress.training import TrainConfig, cast_frozen_linears, resolve_precision, train

UNTRAINABLE_QUANTIZATION = ("int8-wo", "rtn", "gptq", "awq", "hqq", "mixed")
"""Quantized inputs LoRA training refuses: accelerate's `save_state` fails on torchao's int8
tensor subclass ("Attempted to access the data pointer on an invalid python storage")."""


class LoraParams(StepParams):
    rank: int = Field(default=16, gt=0, le=1024)
    """r: the rank of A (r x in) and B (out x r)."""
    alpha: float | None = Field(default=None, gt=0)
    """Scaling numerator; 2 x rank when absent."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    targets: list[str] = Field(default=["q_proj", "v_proj"], min_length=1, max_length=256)
    """Linear layers to adapt, by name or `re:` regex."""
    rslora: bool = False
    """Scale by alpha / sqrt(rank) instead of alpha / rank."""
    data: str = "shift"
    """A named data set (corpus, shift) or a local .jsonl/.json/.txt file."""
    replay_data: str | None = None
    """A second data set mixed into training (rehearsal), so the adapter keeps what the base
    knew: e.g. `corpus` while learning `shift`."""
    replay_fraction: float = Field(default=0.0, ge=0, lt=1)
    """Share of training rows drawn from `replay_data`."""
    steps: int = Field(default=200, gt=0, le=10_000_000)
    lr: float = Field(default=2e-3, gt=0)
    batch_size: int = Field(default=8, gt=0, le=4096)
    seq_len: int = Field(default=128, gt=1, le=131_072)
    mixed_precision: Literal["no", "bf16", "auto"] = "no"
    """`bf16`: train under bfloat16 autocast (float32 master weights); `auto`: bf16 where this
    machine computes it fast (a GPU, an AVX-512 CPU), float32 elsewhere."""

    @field_validator("data", "replay_data")
    @classmethod
    def _data_exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else check_data_in_context(value, info.context)

    @model_validator(mode="after")
    def _replay_pair(self) -> LoraParams:
        if (self.replay_data is None) != (self.replay_fraction == 0):
            raise ValueError("replay_data and replay_fraction go together: give both or neither")
        return self


def training_rows(
    p: LoraParams, tok: object, seed: int, named: DataCatalog = NO_DATA
) -> torch.Tensor:
    """The data's rows, plus replay rows making up `replay_fraction` of the result."""
    rows = token_rows(tok, load_texts(p.data, "train", named), p.seq_len)  # type: ignore[arg-type]
    if p.replay_data is None:
        return rows
    replay_texts = load_texts(p.replay_data, "train", named)
    replay = token_rows(tok, replay_texts, p.seq_len)  # type: ignore[arg-type]
    wanted = round(len(rows) * p.replay_fraction / (1 - p.replay_fraction))
    order = torch.randperm(len(replay), generator=torch.Generator().manual_seed(seed))
    picked = replay[order[torch.arange(wanted) % len(replay)]]
    return torch.cat([rows, picked])


def _causal_lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


@register
class Lora(Step):
    name = "lora"
    Params = LoraParams
    params: LoraParams

    def check(self, artifact: Artifact | None, module_names: list[str] | None) -> None:
        if artifact is not None and artifact.quantization in UNTRAINABLE_QUANTIZATION:
            raise StepError(
                f"LoRA cannot train on a {artifact.quantization} input: its weights are torchao "
                "tensors or packed codes that PEFT does not wrap. For QLoRA quantize with bnb-nf4 "
                "or bnb-int8 instead, or train the LoRA on the full-precision base and serve the "
                f"adapter on the {artifact.quantization} variant (`workbench serve VARIANT --lora "
                "NAME=ADAPTER`)"
            )
        select(module_names, self.params.targets, "lora.targets")

    def planned_output(self, artifact: Artifact) -> Artifact:
        return dataclasses.replace(artifact, kind="adapter", base=artifact.path)

    def apply(self, artifact: Artifact, ctx: StepContext) -> Artifact:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
        from transformers import AutoModelForCausalLM, AutoTokenizer

        p = self.params
        torch.manual_seed(ctx.seed)
        model = AutoModelForCausalLM.from_pretrained(
            artifact.path, dtype=torch.float32, device_map=ctx.device, **NO_HUB_KERNELS
        )
        select([n for n, _ in model.named_modules()], p.targets, "lora.targets")
        if artifact.quantization and artifact.quantization.startswith("bnb-"):
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        config = LoraConfig(
            r=p.rank,
            lora_alpha=p.alpha or 2 * p.rank,  # type: ignore[arg-type]  # PEFT: int; floats work
            lora_dropout=p.dropout,
            target_modules=as_peft_regex(p.targets),
            use_rslora=p.rslora,
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(model, config)
        if resolve_precision(p.mixed_precision) == "bf16":  # the frozen base runs under autocast
            cast_frozen_linears(peft_model)
        tok = AutoTokenizer.from_pretrained(artifact.path)
        rows = training_rows(p, tok, ctx.seed, ctx.data)
        cfg = TrainConfig(
            p.steps,
            p.lr,
            p.batch_size,
            ctx.seed,
            desc="lora",
            checkpoint_every=max(p.steps // 4, 1),
            keep_checkpoints=ctx.keep_checkpoints,
            mixed_precision=p.mixed_precision,
        )
        result = train(peft_model, rows, _causal_lm_loss, cfg, checkpoint_dir=ctx.checkpoint_dir)
        peft_model.save_pretrained(str(ctx.out_dir), safe_serialization=True)
        copy_side_files(artifact.path, ctx.out_dir)
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        info = {
            "trainable_parameters": trainable,
            "first_loss": result.losses[0],
            "final_loss": result.losses[-1],
            "resumed_from_step": result.resumed_from,
            "qlora": bool(artifact.quantization),
            "mixed_precision": resolve_precision(p.mixed_precision),
        }
        return Artifact(
            ctx.out_dir, "adapter", info, base=artifact.path, quantization=artifact.quantization
        )


class MergeParams(StepParams):
    pass


@register
class Merge(Step):
    name = "merge"
    Params = MergeParams
    accepts = ("adapter",)

    def check(self, artifact: Artifact | None, module_names: list[str] | None) -> None:
        if artifact is not None and artifact.quantization:
            raise StepError(
                f"merge needs a full-precision base, but this adapter's base is quantized "
                f"({artifact.quantization}); merge before quantizing, or serve the adapter as is"
            )

    def planned_output(self, artifact: Artifact) -> Artifact:
        return dataclasses.replace(artifact, kind="model", base=None)

    def apply(self, artifact: Artifact, ctx: StepContext) -> Artifact:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        self.check(artifact, [])
        assert artifact.base is not None
        base = AutoModelForCausalLM.from_pretrained(artifact.base, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, artifact.path).merge_and_unload()
        merged.save_pretrained(ctx.out_dir)
        copy_side_files(artifact.base, ctx.out_dir)
        return Artifact(ctx.out_dir, "model", {"merged_adapter": str(artifact.path)})

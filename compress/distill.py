"""The distill step: a smaller student trained on the teacher's logits.

Model: the student has the teacher's architecture with fewer layers (a count, evenly spaced, or
explicit indices) and optionally a narrower hidden / MLP size. It starts from the teacher's kept
layers (plus embeddings, final norm and head) or from random weights. Loss per token:
`alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student)`;
`kd: false` trains the same student on CE alone, the baseline that shows what distillation adds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, ValidationInfo, field_validator, model_validator
from transformers import PretrainedConfig, PreTrainedModel

from compress.artifact import Artifact, copy_side_files
from compress.data import check_data_in_context, load_texts, perplexity, token_rows
from compress.registry import Step, StepContext, StepError, StepParams, register
from compress.training import TrainConfig, resolve_precision, train


class DistillParams(StepParams):
    layers: int | list[int]
    """How many teacher layers the student keeps (evenly spaced), or which (0-based)."""
    hidden_size: int | None = Field(default=None, gt=0)
    """A narrower student (needs init: random); the teacher's width when absent."""
    intermediate_size: int | None = Field(default=None, gt=0)
    init: str = Field(default="teacher", pattern="^(teacher|random)$")
    """teacher: copy the kept layers; random: fresh weights."""
    kd: bool = True
    """False: cross-entropy only (the baseline)."""
    alpha: float = Field(default=0.5, ge=0, le=1)
    temperature: float = Field(default=2.0, gt=0)
    data: str = "corpus"
    steps: int = Field(default=300, gt=0, le=10_000_000)
    lr: float = Field(default=3e-3, gt=0)
    batch_size: int = Field(default=16, gt=0, le=4096)
    seq_len: int = Field(default=128, gt=1, le=131_072)
    mixed_precision: Literal["no", "bf16", "auto"] = "no"
    """`bf16`: train under bfloat16 autocast (float32 master weights); `auto`: bf16 where this
    machine computes it fast (a GPU, an AVX-512 CPU), float32 elsewhere."""
    eval_every: int = Field(default=100, ge=0)
    checkpoint_every: int = Field(default=100, ge=0)

    @field_validator("data")
    @classmethod
    def _data_exists(cls, value: str, info: ValidationInfo) -> str:
        return check_data_in_context(value, info.context)

    @model_validator(mode="after")
    def _shape(self) -> DistillParams:
        if isinstance(self.layers, int) and self.layers < 1:
            raise ValueError(f"layers: found {self.layers}; keep at least 1 layer")
        if isinstance(self.layers, list) and (
            not self.layers or len(set(self.layers)) != len(self.layers)
        ):
            raise ValueError(f"layers: found {self.layers}; give distinct layer indices")
        if isinstance(self.layers, list) and min(self.layers) < 0:
            raise ValueError(
                f"layers: found {self.layers}; layer indices count from 0 (the first layer)"
            )
        narrower = self.hidden_size is not None or self.intermediate_size is not None
        if narrower and self.init == "teacher":
            raise ValueError(
                "a narrower student cannot start from the teacher's layers; set init: random"
            )
        return self


def kept_layers(layers: int | list[int], num_teacher_layers: int) -> list[int]:
    if isinstance(layers, list):
        return sorted(layers)
    return (
        [round(i * (num_teacher_layers - 1) / max(layers - 1, 1)) for i in range(layers)]
        if layers > 1
        else [0]
    )


def student_from(teacher: PreTrainedModel, p: DistillParams, seed: int) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    config: PretrainedConfig = copy.deepcopy(teacher.config)
    keep = kept_layers(p.layers, config.num_hidden_layers)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    config.hidden_size = p.hidden_size or config.hidden_size
    config.intermediate_size = p.intermediate_size or config.intermediate_size
    torch.manual_seed(seed)
    student = AutoModelForCausalLM.from_config(config)
    if p.init == "teacher":
        state = teacher.state_dict()
        for i, j in enumerate(keep):
            prefix_t, prefix_s = f"model.layers.{j}.", f"model.layers.{i}."
            state.update(
                {
                    prefix_s + k[len(prefix_t) :]: v
                    for k, v in teacher.state_dict().items()
                    if k.startswith(prefix_t)
                }
            )
        own = student.state_dict()
        student.load_state_dict({k: state[k] for k in own})
    return student


def _distill_loss(
    teacher: torch.nn.Module, p: DistillParams
) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    def loss(student: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        out = student(input_ids=batch, labels=batch)
        if not p.kd:
            return out.loss
        bf16 = resolve_precision(p.mixed_precision) == "bf16"
        with torch.no_grad(), torch.autocast(batch.device.type, torch.bfloat16, enabled=bf16):
            t_logits = teacher(input_ids=batch).logits
        s = F.log_softmax(out.logits[:, :-1].flatten(0, 1) / p.temperature, -1)
        t = F.log_softmax(t_logits[:, :-1].flatten(0, 1).float() / p.temperature, -1)
        kl = F.kl_div(s, t, log_target=True, reduction="batchmean")
        return p.alpha * p.temperature**2 * kl + (1 - p.alpha) * out.loss

    return loss


@register
class Distill(Step):
    name = "distill"
    Params = DistillParams
    params: DistillParams

    def check(self, artifact: Artifact | None, module_names: list[str] | None) -> None:
        if artifact is not None and artifact.quantization:
            raise StepError(
                f"a quantized teacher ({artifact.quantization}) cannot be distilled from; distill before quantizing"
            )
        if module_names is None:
            return
        num_layers = len({n.split(".")[2] for n in module_names if n.startswith("model.layers.")})
        if isinstance(self.params.layers, list) and max(self.params.layers) >= num_layers:
            raise StepError(
                f"distill.layers: {self.params.layers} names a layer the teacher lacks (it has {num_layers})"
            )
        if isinstance(self.params.layers, int) and self.params.layers > num_layers:
            raise StepError(
                f"distill.layers: {self.params.layers} is more than the teacher's {num_layers}"
            )

    def apply(self, artifact: Artifact, ctx: StepContext) -> Artifact:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        p = self.params
        teacher = AutoModelForCausalLM.from_pretrained(artifact.path, dtype=torch.float32)
        teacher.to(ctx.device)  # type: ignore[arg-type]  # transformers types its `to` oddly
        teacher.eval().requires_grad_(False)
        student = student_from(teacher, p, ctx.seed)
        student.to(ctx.device)  # type: ignore[arg-type]
        tok = AutoTokenizer.from_pretrained(artifact.path)
        rows = token_rows(tok, load_texts(p.data, "train", ctx.data), p.seq_len)
        val = token_rows(tok, load_texts(p.data, "validation", ctx.data), p.seq_len)[:64]
        cfg = TrainConfig(
            p.steps,
            p.lr,
            p.batch_size,
            ctx.seed,
            eval_every=p.eval_every,
            checkpoint_every=p.checkpoint_every,
            keep_checkpoints=ctx.keep_checkpoints,
            mixed_precision=p.mixed_precision,
            desc="distill" if p.kd else "train (CE)",
        )
        result = train(
            student,
            rows,
            _distill_loss(teacher, p),
            cfg,
            lambda m: perplexity(m, val),
            ctx.checkpoint_dir,
        )
        student.save_pretrained(ctx.out_dir)
        copy_side_files(artifact.path, ctx.out_dir)
        info = {
            "kept_layers": kept_layers(p.layers, teacher.config.num_hidden_layers),
            "first_loss": result.losses[0],
            "final_loss": result.losses[-1],
            "validation_perplexity_by_step": result.validation,
            "resumed_from_step": result.resumed_from,
            "teacher_validation_perplexity": perplexity(teacher, val),
            "mixed_precision": resolve_precision(p.mixed_precision),
        }
        return Artifact(ctx.out_dir, "model", info)

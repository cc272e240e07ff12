"""The distill step: a smaller student trained on the teacher's logits.

Model: the student has the teacher's architecture with fewer layers and optionally a narrower
hidden / MLP size. The layers kept are a count, evenly spaced (`select: even`) or the ones that
change the hidden state most on windows of the data (`select: importance`, block influence:
`compress.layer_importance`), or explicit indices. It starts from the teacher's kept layers (plus
embeddings, final norm and head) or from random weights. Loss per token:
`alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student)`,
the KL over the whole vocabulary or (`kd: {top_k: K}`) over the teacher's top-K tokens cached per
window (`compress.kd_loss`); `kd: false` trains the same student on CE alone, the baseline that
shows what distillation adds; `steps: 0` only removes the layers, showing what healing buys.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator
from transformers import PretrainedConfig, PreTrainedModel

from compress.artifact import Artifact, copy_side_files
from compress.calibration import CalibrationParams, calibration_rows
from compress.data import check_data_in_context, load_texts, perplexity, token_rows
from compress.kd_loss import TopKCache, kd_and_ce, top_k_kl
from compress.layer_importance import block_influence, most_influential
from compress.registry import Step, StepContext, StepError, StepParams, register
from compress.training import TrainConfig, cast_frozen_linears, resolve_precision, train

_TEACHER_MEASURES: dict[tuple[Hashable, ...], Any] = {}
"""What a teacher scores on fixed windows (its validation perplexity, block influence), by the
teacher's files and the windows' settings: the students of one teacher built in one process (a
KD student, its CE twin, its removal-only twin) measure it once."""


def _teacher_measure(teacher: Path, what: tuple[Hashable, ...], compute: Callable[[], Any]) -> Any:
    stats = [(f.name, f.stat()) for f in sorted(teacher.iterdir())]
    files = tuple((name, st.st_size, st.st_mtime_ns) for name, st in stats)
    key = (str(teacher.resolve()), files, *what)
    if key not in _TEACHER_MEASURES:
        _TEACHER_MEASURES[key] = compute()
    return _TEACHER_MEASURES[key]


class TopKD(StepParams):
    top_k: int = Field(gt=0, le=1_048_576)
    """Teacher tokens per position whose probabilities the KL keeps (the rest share one)."""


class DistillParams(StepParams):
    layers: int | list[int]
    """How many teacher layers the student keeps, or which (0-based)."""
    select: Literal["even", "importance"] = "even"
    """How a count of layers is chosen: evenly spaced, or by block influence."""
    importance_windows: int = Field(default=32, ge=1, le=4096)
    """Windows of `seq_len` tokens of the data's train split that block influence is measured
    on (with `select: importance`)."""
    hidden_size: int | None = Field(default=None, gt=0)
    """A narrower student (needs init: random); the teacher's width when absent."""
    intermediate_size: int | None = Field(default=None, gt=0)
    init: str = Field(default="teacher", pattern="^(teacher|random)$")
    """teacher: copy the kept layers; random: fresh weights."""
    kd: bool | TopKD = True
    """True: KL over the whole vocabulary; {top_k: K}: over the teacher's cached top-K;
    False: cross-entropy only (the baseline)."""
    alpha: float = Field(default=0.5, ge=0, le=1)
    temperature: float = Field(default=2.0, gt=0)
    data: str = "corpus"
    steps: int = Field(default=300, ge=0, le=10_000_000)
    """Training steps; 0: the kept layers as they are (removal only)."""
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
        if self.select == "importance" and isinstance(self.layers, list):
            raise ValueError(
                f"select: importance chooses the layers, but layers lists them ({self.layers}); "
                "give layers as a count"
            )
        narrower = self.hidden_size is not None or self.intermediate_size is not None
        if narrower and self.init == "teacher":
            raise ValueError(
                "a narrower student cannot start from the teacher's layers; set init: random"
            )
        return self


def kept_layers(layers: int | list[int], num_teacher_layers: int) -> list[int]:
    """The listed layers (sorted), or a count evenly spaced from the first to the last."""
    if isinstance(layers, list):
        return sorted(layers)
    return (
        [round(i * (num_teacher_layers - 1) / max(layers - 1, 1)) for i in range(layers)]
        if layers > 1
        else [0]
    )


def student_from(
    teacher: PreTrainedModel, p: DistillParams, seed: int, keep: list[int]
) -> PreTrainedModel:
    """The student keeping teacher layers `keep` (sorted)."""
    from transformers import AutoModelForCausalLM

    config: PretrainedConfig = copy.deepcopy(teacher.config)
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


def _perplexity(model: torch.nn.Module, rows: torch.Tensor, precision: str) -> float:
    """`perplexity` in the training's precision: the trained student is validated under its
    training's autocast (accelerate's wrapper), so the teacher and an untrained student are too
    (one precision for all three figures). SmolLM2's 64 windows of the corpus: 15.5 s and
    perplexity 30.068 in float32, 9.1 s and 30.081 under bfloat16 autocast."""
    device = next(model.parameters()).device.type
    with torch.autocast(device, torch.bfloat16, enabled=precision == "bf16"):
        return perplexity(model, rows)


def _distill_loss(
    teacher: torch.nn.Module, p: DistillParams, cache: TopKCache | None
) -> Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]:
    def loss(student: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        full = p.kd is True  # the KL and the cross-entropy in one pass (`kd_and_ce`)
        out = student(input_ids=batch) if full else student(input_ids=batch, labels=batch)
        if not p.kd:
            return out.loss
        bf16 = resolve_precision(p.mixed_precision) == "bf16"
        with torch.no_grad(), torch.autocast(batch.device.type, torch.bfloat16, enabled=bf16):
            if cache is not None:
                top = cache.get(teacher, batch)
            else:
                t_logits = teacher(input_ids=batch).logits[:, :-1]
        s_logits = out.logits[:, :-1]
        if cache is None:
            return kd_and_ce(s_logits, t_logits, batch[:, 1:], p.alpha, p.temperature)
        kl = top_k_kl(s_logits, top, p.temperature)
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
        tok = AutoTokenizer.from_pretrained(artifact.path)
        keep, info = self._choose_layers(teacher, artifact.path, tok, ctx)
        student = student_from(teacher, p, ctx.seed, keep)
        student.to(ctx.device)  # type: ignore[arg-type]
        val = token_rows(tok, load_texts(p.data, "validation", ctx.data), p.seq_len)[:64]
        precision = resolve_precision(p.mixed_precision)
        if p.steps and p.kd and precision == "bf16":  # the teacher runs under autocast alone
            cast_frozen_linears(teacher)  # now that the student has copied its weights
        if p.steps:
            info |= self._train(teacher, student, tok, val, ctx)
        student.save_pretrained(ctx.out_dir)
        copy_side_files(artifact.path, ctx.out_dir)
        by_step = info.get("validation_perplexity_by_step")
        info |= {
            "kept_layers": keep,
            # training ends by validating the final weights on `val`: that figure, not a second pass
            "validation_perplexity": by_step[-1][1]
            if by_step
            else _perplexity(student, val, precision),
            "teacher_validation_perplexity": _teacher_measure(
                artifact.path,
                ("validation perplexity", p.data, p.seq_len, val.shape[0], precision),
                lambda: _perplexity(teacher, val, precision),
            ),
            "mixed_precision": precision,
        }
        return Artifact(ctx.out_dir, "model", info)

    def _choose_layers(
        self, teacher: PreTrainedModel, teacher_path: Path, tok: Any, ctx: StepContext
    ) -> tuple[list[int], dict[str, Any]]:
        p = self.params
        total = teacher.config.num_hidden_layers
        if p.select == "even" or isinstance(p.layers, list):
            return kept_layers(p.layers, total), {
                "layer_selection": "even" if isinstance(p.layers, int) else "listed"
            }
        params = CalibrationParams(data=p.data, samples=p.importance_windows, seq_len=p.seq_len)
        try:
            windows = calibration_rows(tok, params, ctx.data, ctx.seed)
        except ValueError as e:
            raise StepError(f"distill.importance_windows: {e}") from None
        what = ("block influence", p.data, p.importance_windows, p.seq_len, ctx.seed)
        scores = _teacher_measure(
            teacher_path, what, lambda: block_influence(teacher, windows.rows)
        )
        info = {
            "layer_selection": "importance",
            "layer_importance": {
                "metric": "block influence: 1 - mean cos(layer input, layer output)",
                "scores": [round(x, 6) for x in scores],
                "windows": windows.record(params),
            },
        }
        return most_influential(scores, p.layers), info

    def _train(
        self,
        teacher: PreTrainedModel,
        student: PreTrainedModel,
        tok: Any,
        val: torch.Tensor,
        ctx: StepContext,
    ) -> dict[str, Any]:
        p = self.params
        rows = token_rows(tok, load_texts(p.data, "train", ctx.data), p.seq_len)
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
        cache = TopKCache(p.kd.top_k, p.temperature) if isinstance(p.kd, TopKD) else None
        started = time.perf_counter()
        result = train(
            student,
            rows,
            _distill_loss(teacher, p, cache),
            cfg,
            lambda m: perplexity(m, val),
            ctx.checkpoint_dir,
        )
        info: dict[str, Any] = {
            "first_loss": result.losses[0],
            "final_loss": result.losses[-1],
            "validation_perplexity_by_step": result.validation,
            "resumed_from_step": result.resumed_from,
            "train_seconds": round(time.perf_counter() - started, 1),
        }
        if cache is not None:
            info["top_k_cache"] = {
                "windows": len(cache.entries),
                "hits": cache.hits,
                "misses": cache.misses,
            }
        return info

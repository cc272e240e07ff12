"""The training loop shared by the distill and lora steps: seeded batches, AdamW with warm-up
and cosine decay, a progress bar, periodic validation, and resumable checkpoints.

Model: the batch of step k is rows[perm[k*B : (k+1)*B]] for one seeded permutation, so a run
resumed at step k sees exactly the batches it would have seen. Training runs through
`accelerate.Accelerator`, so the same code runs on one CPU or under `accelerate launch` /
`torchrun`: with N processes each computes the loss on every N-th row of the global batch and
the gradients are averaged, which is the same update as one process on the whole batch.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float
    batch_size: int
    seed: int = 0
    warmup: int = 10
    eval_every: int = 0
    """Validate every this many steps (0: only at the end)."""
    checkpoint_every: int = 0
    """Save a resumable checkpoint every this many steps before the last (0: never)."""
    keep_checkpoints: int = 1
    """How many of the newest checkpoints to keep; older ones are deleted once a new one is
    complete (so an interruption at any moment leaves one to resume from)."""
    desc: str = "training"
    mixed_precision: str = "no"
    """`bf16`: forward and backward under bfloat16 autocast (weights and optimizer stay float32;
    on CPUs with avx512_bf16 about twice as fast); `auto`: `bf16` where it is fast
    (`fast_bf16`), else `no`."""


def fast_bf16() -> bool:
    """Whether bfloat16 compute is fast here: a CUDA device, or a CPU whose oneDNN runs bf16
    natively (AVX-512). On an AVX2-only CPU bf16 is emulated: a SmolLM2 distillation step took
    128 s under bf16 autocast on one."""
    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_precision(mixed_precision: str) -> str:
    """A step's `mixed_precision` as this machine runs it (`auto` resolved)."""
    if mixed_precision == "auto":
        return "bf16" if fast_bf16() else "no"
    return mixed_precision


def cast_frozen_linears(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Round the weights (and biases) of `model`'s frozen, plain linear layers to `dtype` once,
    for a model run only under `dtype` autocast (a distillation teacher, a LoRA's base): autocast
    rounds them the same way on every forward, so nothing computed changes, only the casts go
    (a SmolLM2 teacher: 135M parameters read and written again every step). A head tied to the
    input embedding gets a cast copy of its own; the embedding, the norms, quantized linears
    and anything trainable keep theirs. Returns the parameters cast."""
    cast = 0
    head = getattr(model, "get_output_embeddings", lambda: None)()
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or type(module) is not torch.nn.Linear:
            continue  # subclasses: quantized (bitsandbytes' Linear4bit, Linear8bitLt)
        if not module.weight.is_floating_point() or module.weight.requires_grad:
            continue
        if module is head and embedding is not None and module.weight is embedding.weight:
            module.weight = torch.nn.Parameter(module.weight.detach().to(dtype), False)
        else:
            module.weight.data = module.weight.data.to(dtype)
        if module.bias is not None:
            module.bias.data = module.bias.data.to(dtype)
        cast += module.weight.numel()
    return cast


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)
    resumed_from: int = 0


def fused_adamw(params: Sequence[torch.Tensor]) -> bool:
    """AdamW's fused kernel (one pass over each parameter: 4.8x the default's speed on a 124M
    float32 model on 2 CPU cores, 0.09 s a step against 0.43) where it runs: floating-point
    parameters on the CPU or CUDA."""
    return bool(params) and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
    )


def lr_at(config: TrainConfig, step: int) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def batch_indices(num_rows: int, config: TrainConfig, step: int) -> torch.Tensor:
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(config.seed))
    return torch.stack(
        [order[(step * config.batch_size + j) % num_rows] for j in range(config.batch_size)]
    )


def train(
    model: torch.nn.Module,
    rows: torch.Tensor,
    loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    config: TrainConfig,
    validate: Callable[[torch.nn.Module], float] | None = None,
    checkpoint_dir: Path | None = None,
) -> TrainResult:
    accelerator = _accelerator(resolve_precision(config.mixed_precision))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.95), fused=fused_adamw(params)
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    result = TrainResult()
    start = _resume(accelerator, checkpoint_dir, result)
    model.train()
    bar = tqdm(
        range(start, config.steps),
        desc=config.desc,
        unit="step",
        leave=False,
        disable=not accelerator.is_local_main_process,
    )
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(config, step)
        indices = batch_indices(len(rows), config, step)
        mine = indices[accelerator.process_index :: accelerator.num_processes]  # this rank's share
        loss = loss_fn(model, rows[mine].to(accelerator.device))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        result.losses.append(accelerator.reduce(loss.detach(), "mean").item())
        bar.set_postfix(loss=f"{result.losses[-1]:.3f}")
        done = step + 1
        if validate and config.eval_every and done % config.eval_every == 0 and done < config.steps:
            result.validation.append((done, validate(accelerator.unwrap_model(model))))
            model.train()
        # not after the last step: the step's artifact is written next and its checkpoints
        # deleted (the student's model and AdamW state: 1.35 GB written for nothing)
        every = config.checkpoint_every
        if checkpoint_dir and every and done % every == 0 and done < config.steps:
            _save(accelerator, checkpoint_dir, done, result)
            if accelerator.is_main_process:
                prune_checkpoints(checkpoint_dir, config.keep_checkpoints)
    if validate:
        result.validation.append((config.steps, validate(accelerator.unwrap_model(model))))
    return result


def _accelerator(precision: str) -> Any:
    """An `Accelerator` for this training's precision. accelerate keeps one state per process and
    refuses a second precision in it ("restart your runtime"), but a recipe may train one variant
    in bf16 and the next in float32 in one process: the precision part of the state is reset
    when it differs (the processes' part, `PartialState`, stays: distributed runs keep theirs)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    state = AcceleratorState._shared_state
    if state and state.get("_mixed_precision", precision) != precision:
        AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=precision)


def _save(accelerator: Any, checkpoint_dir: Path, step: int, result: TrainResult) -> None:
    target = checkpoint_dir / f"step-{step}"
    accelerator.save_state(str(target))
    if accelerator.is_main_process:
        progress = {"step": step, "losses": result.losses, "validation": result.validation}
        (target / "progress.json").write_text(json.dumps(progress))
        (checkpoint_dir / "latest").write_text(target.name)
    accelerator.wait_for_everyone()


def prune_checkpoints(checkpoint_dir: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` newest `step-N` checkpoints (never the one `latest` names)."""
    latest = (checkpoint_dir / "latest").read_text().strip()
    steps = sorted(
        (p for p in checkpoint_dir.glob("step-*") if p.name.removeprefix("step-").isdigit()),
        key=lambda p: int(p.name.removeprefix("step-")),
    )
    doomed = [p for p in steps[: max(0, len(steps) - max(keep, 1))] if p.name != latest]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _resume(accelerator: object, checkpoint_dir: Path | None, result: TrainResult) -> int:
    if checkpoint_dir is None or not (checkpoint_dir / "latest").is_file():
        return 0
    target = checkpoint_dir / (checkpoint_dir / "latest").read_text().strip()
    if not (target / "progress.json").is_file():
        return 0
    accelerator.load_state(str(target))  # type: ignore[attr-defined]
    progress = json.loads((target / "progress.json").read_text())
    result.losses = progress["losses"]
    result.validation = [tuple(v) for v in progress["validation"]]
    result.resumed_from = progress["step"]
    return progress["step"]

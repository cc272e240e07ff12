"""What each task of a recipe's run asks of a cluster: CPUs, GPUs, memory, a GPU type.

Model: a recipe may say `resources:` per variant (its build steps) and per kind of measurement
(the top-level `resources: {quality: ..., divergence: ..., load: ...}`); whatever it leaves out
is derived from the base's size and the kind of work (`default_shape`). The local executor runs
one task at a time and ignores shapes; the Ray executor turns each into a task's options. Load
ramps also take the node's one `workbench_load_slot`, so two latency measurements never share a
machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat

LOAD_SLOT = "workbench_load_slot"
"""The custom resource each node declares once (`ray start --resources '{"workbench_load_slot": 1}'`)."""

TaskKind = Literal[
    "build", "calibrate", "train", "mirror", "quality", "divergence", "serving", "report"
]
TRAINING_STEPS = frozenset({"distill", "lora"})
CALIBRATED_METHODS = frozenset({"gptq", "awq"})
"""Quantization methods that run the model over calibration data (worth a GPU)."""

_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]i?B)?$")
_UNIT = {
    None: 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}


def memory_bytes(text: str) -> int:
    """`8GiB`, `512 MB` or a plain number of bytes, as bytes."""
    match = _MEMORY.match(text.strip())
    assert match is not None, f"{text!r}: validated by Resources.memory's pattern"
    return int(float(match.group(1)) * _UNIT[match.group(2)])


class Resources(BaseModel):
    """A task's request; every field left out is derived (`default_shape`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cpus: PositiveFloat | None = Field(default=None, le=1024)
    """CPU cores the task holds (Ray's `num_cpus`)."""
    gpus: NonNegativeFloat | None = Field(default=None, le=64)
    """GPUs the task holds (Ray's `num_gpus`); a GPU task runs in a process of its own, which
    exits afterwards, so its GPU memory is freed before the next variant."""
    memory: str | None = Field(default=None, pattern=_MEMORY.pattern)
    """Host memory the task reserves, e.g. `16GiB` (Ray's `memory`)."""
    accelerator_type: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$")
    """Only on nodes with this GPU type (Ray's `accelerator_type`, e.g. `H100`, `A10G`)."""


class EvalResources(BaseModel):
    """The recipe's top-level `resources:`: per kind of measurement."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quality: Resources = Resources()
    divergence: Resources = Resources()
    load: Resources = Resources()
    """The serving measurements (load ramps, chat answers, server check): one server at a time."""


@dataclass(frozen=True)
class Shape:
    """A task's resolved request, as the Ray executor passes it (`memory` in bytes)."""

    cpus: float
    gpus: float
    memory: int
    accelerator_type: str | None = None
    load_slot: bool = False

    @property
    def label(self) -> str:
        gpu = f", {self.gpus:g} GPU" if self.gpus else ""
        kind = f" {self.accelerator_type}" if self.accelerator_type and self.gpus else ""
        return f"{self.cpus:g} CPU{gpu}{kind}, {self.memory / 2**30:.1f} GiB"


MEMORY_FACTOR: dict[TaskKind, float] = {
    "build": 2.0,  # the input and the output model side by side
    "calibrate": 2.5,  # the model, its quantized copy and calibration activations
    "train": 4.0,  # teacher or base, the trained weights, their gradients and optimizer state
    "mirror": 0.0,
    "quality": 1.5,
    "divergence": 2.5,  # the variant and its reference
    "serving": 2.0,  # the server's weights and KV cache, the client
    "report": 0.0,
}
"""Host memory per kind of task, in multiples of the base's float32 weights."""
MIN_MEMORY = 256 * 2**20


def step_kind(step: str, method: str | None) -> TaskKind:
    """The kind of task a build step is: training, calibrated quantization, or plain rewriting."""
    if step in TRAINING_STEPS:
        return "train"
    return "calibrate" if method in CALIBRATED_METHODS else "build"


def default_shape(kind: TaskKind, base_bytes: int, gpus: bool) -> Shape:
    """The request of a task of `kind` on a base whose float32 weights take `base_bytes`;
    `gpus`: the recipe may run on GPUs (its device is not `cpu`) and the cluster has some."""
    gpu_work = kind in ("calibrate", "train", "quality", "divergence", "serving")
    memory = max(int(base_bytes * MEMORY_FACTOR[kind]), MIN_MEMORY)
    cpus = 2.0 if kind == "serving" else 1.0  # the server and its load client
    if kind in ("mirror", "report"):
        return Shape(cpus=0.1, gpus=0.0, memory=0)
    return Shape(cpus, 1.0 if gpus and gpu_work else 0.0, memory, load_slot=kind == "serving")


def resolve(asked: Resources, default: Shape) -> Shape:
    """`default` with what the recipe asked for in its place."""
    return Shape(
        cpus=asked.cpus if asked.cpus is not None else default.cpus,
        gpus=asked.gpus if asked.gpus is not None else default.gpus,
        memory=memory_bytes(asked.memory) if asked.memory is not None else default.memory,
        accelerator_type=asked.accelerator_type,
        load_slot=default.load_slot,
    )

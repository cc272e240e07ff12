"""The step registry: recipe step names to step classes.

Contract: a step is a class with a pydantic `Params` model (extra keys forbidden) and one method,
`apply(artifact, ctx) -> Artifact`, which reads the input artifact and writes its output into
`ctx.out_dir` (an empty temporary dir that the pipeline renames into place when `apply` returns).
A step never writes anywhere else and keeps no state between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from compress.artifact import Artifact
from compress.data import NO_DATA, DataCatalog


class StepParams(BaseModel):
    """Base of every step's params: what a recipe may write under the step's name."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class StepContext:
    out_dir: Path
    """Empty dir to write the output artifact into."""
    seed: int = 0
    device: str = "cpu"
    checkpoint_dir: Path | None = None
    """A dir that survives an interrupted run (for training checkpoints); the pipeline deletes
    it once the step's artifact is complete."""
    keep_checkpoints: int = 1
    """Training checkpoints kept in `checkpoint_dir` (older ones are deleted as new ones land)."""
    data: DataCatalog = field(default_factory=lambda: NO_DATA)
    """The named data sets a step's `data` may name (the pipeline passes `catalog.data.NAMED`)."""


class StepError(ValueError):
    """A step cannot run with these params on this input; the message names the fix."""


class Step:
    name: ClassVar[str]
    Params: ClassVar[type[StepParams]] = StepParams

    def __init__(self, params: StepParams) -> None:
        self.params = params

    accepts: ClassVar[tuple[str, ...]] = ("model",)
    """Artifact kinds this step can take as input."""

    def check(self, artifact: Artifact | None, module_names: list[str] | None) -> None:
        """Refuse, before anything runs, params that cannot work on this model (e.g. targets
        matching no module); `artifact` is the input when known, `module_names` the base's
        (None when the base is not at hand yet: check what needs no module names)."""

    def planned_output(self, artifact: Artifact) -> Artifact:
        """What `apply` will make of this input, as far as kind and quantization go (the
        pipeline checks step order with it before running anything)."""
        return artifact

    def apply(self, artifact: Artifact, ctx: StepContext) -> Artifact:
        raise NotImplementedError


STEPS: dict[str, type[Step]] = {}


def register(cls: type[Step]) -> type[Step]:
    if cls.name in STEPS:
        raise ValueError(f"step {cls.name!r} is registered twice")
    STEPS[cls.name] = cls
    return cls

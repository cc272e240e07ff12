"""Steps that turn one artifact into another; importing this package registers all of them."""

from compress import identity  # noqa: F401  (registers the step)
from compress.artifact import Artifact
from compress.registry import STEPS, Step, StepContext, StepParams

__all__ = ["STEPS", "Artifact", "Step", "StepContext", "StepParams"]

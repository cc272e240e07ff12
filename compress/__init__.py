"""Steps that turn one artifact into another; importing this package registers all of them."""

from compress import distill, identity, lora, quantize  # noqa: F401  (register the steps)
from compress.artifact import Artifact
from compress.registry import STEPS, Step, StepContext, StepError, StepParams

__all__ = ["STEPS", "Artifact", "Step", "StepContext", "StepError", "StepParams"]

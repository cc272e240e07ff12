"""workbench: derive, serve, evaluate and compare compressed and adapted variants of a causal LM."""

import logging
from typing import TYPE_CHECKING, Any

# torchao warns at import about its CUDA-only extensions on CPU machines, and torch about how
# torchao registers enums; neither is for the user to act on.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
# bitsandbytes logs a cast warning on every int8 matmul with float32 inputs (the CPU's dtype).
logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from workbench.run_recipe import RunResult, run

__all__ = ["RunResult", "run"]


def __getattr__(name: str) -> Any:
    """`workbench.run(recipe) -> RunResult`, loaded on first use (PEP 562): importing the
    package for its CLI or recipe schema does not load the evals and the report."""
    if name in __all__:
        from workbench import run_recipe

        return getattr(run_recipe, name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")

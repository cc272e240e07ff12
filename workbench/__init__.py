"""workbench: derive, serve, evaluate and compare compressed and adapted variants of a causal LM."""

import logging

# torchao warns at import about its CUDA-only extensions on CPU machines, and torch about how
# torchao registers enums; neither is for the user to act on.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
# bitsandbytes logs a cast warning on every int8 matmul with float32 inputs (the CPU's dtype).
logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)

__version__ = "0.1.0"

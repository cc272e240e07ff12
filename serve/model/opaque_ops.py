"""The engine's ops that `torch.compile` keeps opaque (`workbench::packed_linear`,
`workbench::paged_attention`), registered with the dispatcher directly.

Model: `torch.library.custom_op` routes every call through Python layers of its own (autograd
registration, argument checks) that cost about 20 us a call on a 2-core CPU, against about 2 us
for an op defined with `torch.library.Library` and one `CompositeExplicitAutograd` kernel (one
kernel for every backend key: the prepacked weight's key is MkldnnCPU, not CPU). A compiled
step calls these ops once per linear and per layer (65 calls a step on a small Llama), so the
wrapper was 5-10% of a one-sequence decode step. The ops are for inference: no autograd formula.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARY = torch.library.Library("workbench", "DEF")


def define_opaque_op(
    schema: str, kernel: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]
) -> torch._ops.OpOverload:
    """Define `workbench::<schema>` with `kernel` for every backend and `fake` for tracing;
    returns the op's default overload (call it like a function)."""
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"workbench::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.workbench, name).default

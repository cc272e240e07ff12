"""RMSNorm layers through torch's one-pass `rms_norm` kernel.

Model: transformers' RMSNorm modules compute `x * rsqrt(mean(x^2) + eps)` in float32 as five eager
operators, each a pass over the hidden states with a temporary, then apply the weight (Llama:
`w * y.to(dtype)`; Gemma: `(y * (1 + w)).to(dtype)`). `F.rms_norm` computes the same in one pass.
`fuse_rms_norms` replaces a norm module only by a form that gives bitwise its output on probe
inputs of the module's dtype (checked at swap time, so a model whose norm differs keeps its own);
the engine's outputs stay exactly what they were.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

PROBE_ROWS = (1, 37)
"""Rows of the probe inputs: a decode row and a ragged batch (the kernel splits work by rows)."""


class FusedNorm(nn.Module):
    """`F.rms_norm` over the last dim with `scale` inside it (`weight_after`: False), or without
    a scale, cast to the input dtype and then multiplied by `scale` (`weight_after`: True, as
    Llama does for half-precision inputs). `weight` is the replaced module's own parameter (what
    readers of a norm's weight find), `scale` the factor derived from it."""

    weight: nn.Parameter
    scale: torch.Tensor

    def __init__(
        self, weight: nn.Parameter, scale: torch.Tensor, eps: float, weight_after: bool
    ) -> None:
        super().__init__()
        self.weight = weight
        self.register_buffer("scale", scale, persistent=False)
        self.eps, self.weight_after = eps, weight_after
        self.shape = (scale.shape[-1],)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_after:
            return self.scale * F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
        return F.rms_norm(x.float(), self.shape, self.scale, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.shape}, eps={self.eps}, weight_after={self.weight_after}"


def _eps(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _candidates(module: nn.Module) -> list[Callable[[], FusedNorm]]:
    """Forms a norm module may compute: the weight inside the float32 kernel or applied after
    the cast (Llama), or `1 + weight` inside (Gemma)."""
    weight, eps = getattr(module, "weight", None), _eps(module)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None:
        return []
    w = weight.detach()
    return [
        lambda: FusedNorm(weight, w.float(), eps, weight_after=False),
        lambda: FusedNorm(weight, w, eps, weight_after=True),
        lambda: FusedNorm(weight, 1.0 + w.float(), eps, weight_after=False),
    ]


@torch.inference_mode()
def _same_output(original: nn.Module, fused: nn.Module, dim: int, dtypes: set[torch.dtype]) -> bool:
    generator = torch.Generator().manual_seed(dim)
    for dtype in sorted(dtypes, key=str):
        for rows in PROBE_ROWS:
            for spread in (0.05, 1.0, 30.0):
                x = (torch.randn(rows, dim, generator=generator) * spread).to(dtype)
                if not torch.equal(original(x), fused(x)):
                    return False
    return True


def fused_form(module: nn.Module, dtype: torch.dtype) -> FusedNorm | None:
    """The one-pass form of an RMSNorm module whose output it equals bitwise for inputs of
    `dtype`, of float32 and of its weight's dtype (a quantized model's hidden states may be
    either), or None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu":
        return None
    dtypes = {dtype, torch.float32, weight.dtype}
    for make in _candidates(module):
        fused = make()
        if _same_output(module, fused, weight.shape[-1], dtypes):
            return fused
    return None


def fuse_rms_norms(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every CPU module whose class name ends in `RMSNorm` by its one-pass form where
    one gives bitwise the same output for `dtype` inputs; returns how many were replaced."""
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if type(m).__name__.endswith("RMSNorm") and not isinstance(m, FusedNorm)
    ]
    replaced = 0
    for name, module in targets:
        fused = fused_form(module, dtype)
        if fused is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, fused)
        replaced += 1
    return replaced

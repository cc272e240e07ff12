"""The fused elementwise kernels of the eager CPU engine (`kernels/fused_ops.c`) as torch calls.

Model: each op is one pass over 2-D [rows, values] tensors whose rows may be column slices of
a merged projection (read and, for the rotary embedding, written in place). A norm is given as
a `NormWeight`: Llama's RMSNorm (`weight * T(x * inv)`) or Gemma's (`T(x * inv * (1 + weight))`
in float32), so one kernel serves both with each family's rounding. Every row's result is the
same whatever the call's row count (no torch fallback for small calls: a row computed in a
one-row decode step and in a prefill chunk must round alike, or a prefix-cache hit would
change a request's logprobs).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from serve.model.native import KERNELS, ROUNDED_AS_WRITTEN, load_library

SOURCE = KERNELS / "fused_ops.c"
COMPILE = ROUNDED_AS_WRITTEN
"""The products and sums round as torch's do (see the kernel's header)."""
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES: dict[str, list[type]] = {
    "rms_norm": [_P, _I, _P, _N, _P, _I, _I, _F, _N],
    "add_rms_norm": [_P, _P, _P, _P, _N, _P, _I, _I, _F, _N],
    "norm_add_rms_norm": [_P, _P, _P, _P, _P, _N, _P, _I, _I, _F, _N],
    "norm_rotary": [_P, _I, _I, _I, _P, _N, _F, _P, _P, _I, _N],
    "act_mul": [_P, _I, _P, _I, _P, _I, _I, _N, _N],
}

LLAMA_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
"""RMSNorms computing `weight * T(x * rsqrt(mean(x^2) + eps))`."""
GEMMA_NORMS = ("Gemma3RMSNorm",)
"""RMSNorms computing `T(x * rsqrt(mean(x^2) + eps) * (1 + weight))` in float32."""
ACTIVATIONS = {"SiLUActivation": 0, "SiLU": 0, "GELUTanh": 1}
"""Activation modules by class name -> the kernel's act (SILU, GELU_TANH)."""


@cache
def load_ops() -> ctypes.CDLL | None:
    """The fused-op library, built on first use; None (and one log line) where it cannot be."""
    signatures = {f"{op}_{s}": types for op, types in _SIGNATURES.items() for s in DTYPES.values()}
    unavailable = "fused decoder layers unavailable (transformers' layers kept)"
    return load_library(SOURCE, COMPILE, signatures, unavailable)


@dataclass(frozen=True)
class NormWeight:
    """What the kernels need of one RMSNorm module."""

    weight: torch.Tensor
    """Llama's: the module's weight; Gemma's: 1 + weight, float32."""
    f32_weight: bool
    eps: float

    @classmethod
    def of(cls, norm: Any) -> NormWeight:
        if cls.gemma_style(norm):
            return cls((1.0 + norm.weight.detach().float()).contiguous(), True, float(norm.eps))
        assert type(norm).__name__ in LLAMA_NORMS, type(norm).__name__
        return cls(norm.weight, False, float(norm.variance_epsilon))

    @staticmethod
    def gemma_style(norm: Any) -> bool:
        """Gemma's (1 + w) norm (a float32 weight for the kernel), not Llama's."""
        return type(norm).__name__ in GEMMA_NORMS

    @classmethod
    def fusable(cls, norm: Any, dtype: torch.dtype) -> bool:
        llama_style = type(norm).__name__ in LLAMA_NORMS and norm.weight.dtype == dtype
        return cls.gemma_style(norm) or llama_style


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """`x` as rows whose values are contiguous (a column slice stays a view)."""
    return x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()


class FusedOps:
    """The kernels for one dtype, called on 2-D [rows, values] tensors."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = DTYPES[dtype]
        self._norm, self._add_norm, self._norm_add_norm, self._norm_rotary, self._act_mul = (
            getattr(lib, f"{op}_{suffix}") for op in _SIGNATURES
        )

    def rms_norm(self, x: torch.Tensor, norm: NormWeight) -> torch.Tensor:
        x = rows_of(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._norm(
            x.data_ptr(), x.stride(0), norm.weight.data_ptr(), norm.f32_weight, out.data_ptr(),
            x.shape[0], x.shape[1], norm.eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, a: torch.Tensor, b: torch.Tensor, norm: NormWeight
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a + b, norm(a + b))."""
        a, b = a.contiguous(), b.contiguous()
        total, out = torch.empty_like(a), torch.empty_like(a)
        self._add_norm(
            a.data_ptr(), b.data_ptr(), total.data_ptr(), norm.weight.data_ptr(),
            norm.f32_weight, out.data_ptr(), a.shape[0], a.shape[1], norm.eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return total, out

    def norm_add_rms_norm(
        self, a: torch.Tensor, a_norm: NormWeight, b: torch.Tensor, norm: NormWeight | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(b + a_norm(a), norm(b + a_norm(a)) or None without `norm`); both norms of one kind
        and one eps (a layer's norms share its config's)."""
        a, b = a.contiguous(), b.contiguous()
        total = torch.empty_like(a)
        out = torch.empty_like(a) if norm is not None else None
        self._norm_add_norm(
            a.data_ptr(), a_norm.weight.data_ptr(), b.data_ptr(), total.data_ptr(),
            norm.weight.data_ptr() if norm is not None else None, a_norm.f32_weight,
            out.data_ptr() if out is not None else None, a.shape[0], a.shape[1], a_norm.eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return total, out

    def rotary(
        self,
        x: torch.Tensor,
        heads: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        norm: NormWeight | None = None,
    ) -> None:
        """In place on x [rows, heads * head_dim] (its values contiguous): each head normed by
        `norm` (q/k norms) when given, then rotated; cos and sin [rows, head_dim] contiguous."""
        assert x.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
        self._norm_rotary(
            x.data_ptr(), x.stride(0), heads, cos.shape[1],
            norm.weight.data_ptr() if norm is not None else None,
            norm is not None and norm.f32_weight, norm.eps if norm is not None else 0.0,
            cos.data_ptr(), sin.data_ptr(), x.shape[0], torch.get_num_threads(),
        )  # fmt: skip

    def act_mul(self, gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
        """act(gate) * up, act one of `ACTIVATIONS`' values."""
        gate, up = rows_of(gate), rows_of(up)
        out = torch.empty(gate.shape, dtype=gate.dtype)
        self._act_mul(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
            gate.shape[0], gate.shape[1], act, torch.get_num_threads(),
        )  # fmt: skip
        return out

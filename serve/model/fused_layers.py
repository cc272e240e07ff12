"""Llama-family decoder layers with their elementwise work fused, for the eager CPU engine.

Model: besides its linears, transformers' eager decoder layer runs about forty small operators
(RMSNorm's seven, twice; the rotary embedding's fourteen; SiLU and its product; the residual
adds), each a pass over the step's activations plus its Python; on a 2-core CPU they were
~1.0 s of a 64-request mixed workload's 8.7 s, against 0.02 s in vLLM's compiled graphs.
`fuse_decoder_layers` replaces each decoder layer of a known Llama-family architecture
(`ARCHITECTURES`) by a `FusedDecoderLayer` holding the same submodules under the same names (its
linears, prepacked, quantized or LoRA-wrapped, are called as before), which runs RMSNorm, the
residual add with the next RMSNorm, the rotary embedding (in place on the q and k projections)
and SiLU(gate) x up as one C kernel pass each (`kernels/fused_ops.c`) and calls paged attention
with token-major tensors (no transposes). The model's final norm becomes a `FusedRMSNorm`.
Results equal transformers' module by module up to float32 rounding (the norm's sum, SiLU's exp;
the rotary embedding and every product bit for bit); the engine tests stay token-exact against
`generate`. Eager CPU float32 / bfloat16 only: `torch.compile` fuses the same work itself.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from serve.model.attention import ATTENTION_NAME, attend_tokens
from serve.model.native import KERNELS, build_library, declare

log = logging.getLogger(__name__)

SOURCE = KERNELS / "fused_ops.c"
COMPILE = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
]
"""No -ffast-math: the products and sums round as torch's do (see the kernel's header)."""
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES: dict[str, list[type]] = {
    "rms_norm": [_P, _I, _P, _P, _I, _I, _F, _N],
    "add_rms_norm": [_P, _P, _P, _P, _P, _I, _I, _F, _N],
    "rotary": [_P, _I, _I, _I, _P, _P, _I, _N],
    "silu_mul": [_P, _I, _P, _I, _P, _I, _I, _N],
}

NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
"""RMSNorm classes computing `weight * (x * rsqrt(mean(x^2) + eps))`, as the kernel does."""
ARCHITECTURES: dict[str, Callable[[nn.Module], int | None]] = {
    "LlamaDecoderLayer": lambda attn: None,
    "MistralDecoderLayer": lambda attn: getattr(attn.config, "sliding_window", None),
    "Qwen2DecoderLayer": lambda attn: getattr(attn, "sliding_window", None),
}
"""Decoder layers whose forward is Llama's (pre-norm attention and SiLU MLP, rotary embedding
on q and k), with how each finds its attention's sliding window (None: global)."""


@cache
def load_ops() -> ctypes.CDLL | None:
    """The fused-op library, built on first use; None (and one log line) where it cannot be."""
    lib, why_not = build_library(SOURCE, COMPILE)
    if lib is None:
        log.warning("fused decoder layers unavailable (transformers' layers kept): %s", why_not)
        return None
    for op, argtypes in _SIGNATURES.items():
        declare(lib, [f"{op}_{suffix}" for suffix in _SUFFIX.values()], argtypes)
    return lib


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as rows whose values are contiguous (a column slice stays a view)."""
    return x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()


class FusedOps:
    """The kernels for one dtype, called on 2-D [rows, values] tensors. Every row's result is
    the same whatever the call's row count (no torch fallback for small calls: a row computed
    in a one-row decode step and in a prefill chunk must round alike, or a prefix-cache hit
    would change a request's logprobs)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = _SUFFIX[dtype]
        self._norm, self._add_norm, self._rotary, self._silu_mul = (
            getattr(lib, f"{op}_{suffix}") for op in _SIGNATURES
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x = _rows(x)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._norm(
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
            eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(a + b, rms_norm(a + b))."""
        a, b = a.contiguous(), b.contiguous()
        total, out = torch.empty_like(a), torch.empty_like(a)
        self._add_norm(
            a.data_ptr(), b.data_ptr(), total.data_ptr(), weight.data_ptr(), out.data_ptr(),
            a.shape[0], a.shape[1], eps, torch.get_num_threads(),
        )  # fmt: skip
        return total, out

    def rotary(self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """In place: x [rows, heads * head_dim] (its values contiguous), cos and sin
        [rows, head_dim] contiguous."""
        assert x.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
        self._rotary(
            x.data_ptr(), x.stride(0), heads, cos.shape[1], cos.data_ptr(), sin.data_ptr(),
            x.shape[0], torch.get_num_threads(),
        )  # fmt: skip

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = _rows(gate), _rows(up)
        out = torch.empty(gate.shape, dtype=gate.dtype)
        self._silu_mul(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
            gate.shape[0], gate.shape[1], torch.get_num_threads(),
        )  # fmt: skip
        return out


class FusedRMSNorm(nn.Module):
    """An RMSNorm of `NORMS` through the kernel (same weight)."""

    def __init__(self, norm: Any, ops: FusedOps) -> None:
        super().__init__()
        self.weight, self.variance_epsilon, self.ops = norm.weight, norm.variance_epsilon, ops

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = self.ops.rms_norm(x, self.weight, self.variance_epsilon)
        return out.view(hidden_states.shape)


class FusedDecoderLayer(nn.Module):
    """A Llama-style decoder layer (`ARCHITECTURES`) over its original submodules."""

    self_attn: Any  # transformers' attention module: q/k/v/o_proj
    mlp: Any  # gate_proj, up_proj, down_proj
    input_layernorm: Any
    post_attention_layernorm: Any

    def __init__(self, layer: Any, ops: FusedOps, window: int | None) -> None:
        super().__init__()
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.ops, self.window = ops, window
        attn: Any = layer.self_attn
        self.heads: int = attn.config.num_attention_heads
        self.kv_heads: int = attn.config.num_key_value_heads
        self.head_dim: int = attn.head_dim
        self.layer_idx: int = attn.layer_idx
        self.scaling: float = attn.scaling

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """[1, T, hidden] -> [1, T, hidden]; the other arguments of transformers' layer
        call (masks, cache) are not used: paged attention reads the step's metadata."""
        assert position_embeddings is not None, "the model passes its rotary cos and sin"
        x = hidden_states[0]
        cos, sin = (t[0].contiguous() for t in position_embeddings)
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h = self.ops.rms_norm(x, norm1.weight, norm1.variance_epsilon)
        residual, h = self.ops.add_rms_norm(
            x, self._attention(h, cos, sin), norm2.weight, norm2.variance_epsilon
        )
        mlp = self.mlp
        out = residual + mlp.down_proj(self.ops.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
        return out[None]

    def _attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn, t, d = self.self_attn, h.shape[0], self.head_dim
        q, k, v = _rows(attn.q_proj(h)), _rows(attn.k_proj(h)), attn.v_proj(h)
        self.ops.rotary(q, self.heads, cos, sin)
        self.ops.rotary(k, self.kv_heads, cos, sin)
        o = attend_tokens(
            q.view(t, self.heads, d),
            k.view(t, self.kv_heads, d),
            v.reshape(t, self.kv_heads, d),
            self.layer_idx,
            self.scaling,
            self.window,
        )
        return attn.o_proj(o.reshape(t, self.heads * d))


def _fusable(layer: nn.Module, dtype: torch.dtype) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms: list[Any] = [
        getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")
    ]
    return (
        type(layer).__name__ in ARCHITECTURES
        and attn is not None
        and mlp is not None
        and all(type(n).__name__ in NORMS and n.weight.dtype == dtype for n in norms)
        and type(mlp.act_fn).__name__ in ("SiLUActivation", "SiLU")
        and attn.config._attn_implementation == ATTENTION_NAME
        and attn.head_dim % 2 == 0
    )


def why_not_fusable(model: PreTrainedModel) -> str | None:
    """Why this model's decoder layers stay transformers' own (None: they can be fused)."""
    if model.device.type != "cpu" or model.dtype not in _SUFFIX:
        return f"fused layers run on the CPU in float32 or bfloat16 (here: {model.device}, {model.dtype})"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(_fusable(m, model.dtype) for m in layers):
        return "its decoder layers are not one of " + ", ".join(ARCHITECTURES)
    if load_ops() is None:
        return "the fused-op kernels could not be built here (no C compiler?)"
    return None


def fuse_decoder_layers(model: PreTrainedModel) -> int:
    """Replace every decoder layer (and the final norm) of a fusable model (`why_not_fusable`)
    by its fused form; returns how many layers were replaced (0: the model is left as is)."""
    if why_not_fusable(model) is not None:
        return 0
    lib = load_ops()
    assert lib is not None  # checked by why_not_fusable
    ops = FusedOps(lib, model.dtype)
    base: Any = model.model
    for i, layer in enumerate(base.layers):
        window = ARCHITECTURES[type(layer).__name__](layer.self_attn)
        base.layers[i] = FusedDecoderLayer(layer, ops, window)
    if type(getattr(base, "norm", None)).__name__ in NORMS:
        base.norm = FusedRMSNorm(base.norm, ops)
    return len(base.layers)

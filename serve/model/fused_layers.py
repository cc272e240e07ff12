"""Decoder layers with their elementwise work fused, for the eager CPU engine.

Model: besides its linears, transformers' eager decoder layer runs dozens of small operators
(each RMSNorm's seven; the rotary embedding's fourteen; the activation and its product; the
residual adds), each a pass over the step's activations plus its Python; on a 2-core CPU they
were ~1.0 s of a 64-request mixed workload's 8.7 s on a 25M Llama (Gemma 3 270M: 4.5 s of 61 s),
against 0.02 s in vLLM's compiled graphs. `fuse_decoder_layers` replaces each decoder layer of a
known architecture (`ARCHITECTURES`) by a fused layer holding the same submodules under the same
names (its linears, prepacked, quantized or LoRA-wrapped, are called as before), which runs the
norms (with the residual adds beside them), the q/k norms with the rotary embedding (in place on
the q and k projections) and act(gate) x up as one kernel pass each (`serve/model/fused_ops.py`)
and calls paged attention with token-major tensors (no transposes). Two layer shapes:
- `FusedDecoderLayer`: Llama's pre-norm layer (Llama, Mistral, Qwen 2; Qwen 3 with q/k norms).
- `FusedSandwichLayer`: Gemma 3's, whose attention and MLP outputs are normed again before
  their residual adds, with (1 + w) norms, q/k norms and GELU (tanh).
The model's final norm becomes a `FusedRMSNorm`. Results equal transformers' module by module
up to float32 rounding (the norm's sum, the activations' exp; the rotary embedding and every
product bit for bit); the engine tests stay token-exact against `generate`. Eager CPU float32 /
bfloat16 only: `torch.compile` fuses the same work itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from serve.model.attention import ATTENTION_NAME, attend_tokens
from serve.model.fused_ops import ACTIVATIONS, DTYPES, FusedOps, NormWeight, load_ops, rows_of


def _sliding(attn: nn.Module) -> int | None:
    return getattr(attn, "sliding_window", None)


ARCHITECTURES: dict[str, Callable[[nn.Module], int | None]] = {
    "LlamaDecoderLayer": lambda attn: None,
    "MistralDecoderLayer": lambda attn: getattr(attn.config, "sliding_window", None),
    "Qwen2DecoderLayer": _sliding,
    "Qwen3DecoderLayer": _sliding,
    "Gemma3DecoderLayer": _sliding,
}
"""Decoder layers the engine fuses, with how each finds its attention's sliding window (None:
global)."""
SANDWICH = ("Gemma3DecoderLayer",)
"""Of those, the layers with Gemma's sandwich norms (`FusedSandwichLayer`)."""
_NORMS = ("input_layernorm", "post_attention_layernorm")
_SANDWICH_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


class FusedRMSNorm(nn.Module):
    """An RMSNorm through the kernel (same weight)."""

    def __init__(self, norm: Any, ops: FusedOps) -> None:
        super().__init__()
        self.weight, self.norm, self.ops = norm.weight, NormWeight.of(norm), ops

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        return self.ops.rms_norm(x, self.norm).view(hidden_states.shape)


class FusedDecoderLayer(nn.Module):
    """A Llama-style decoder layer (pre-norm attention, then pre-norm gated MLP) over its
    original submodules; q and k are normed per head first where the attention has q/k norms."""

    self_attn: Any  # transformers' attention module: q/k/v/o_proj, maybe q_norm and k_norm
    mlp: Any  # gate_proj, up_proj, down_proj, act_fn

    def __init__(self, layer: Any, ops: FusedOps, window: int | None) -> None:
        super().__init__()
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        for name in _NORMS:
            setattr(self, name, getattr(layer, name))
        self.norms = {name: NormWeight.of(getattr(layer, name)) for name in _NORMS}
        self.ops, self.window = ops, window
        attn: Any = layer.self_attn
        self.qk_norms = (
            (NormWeight.of(attn.q_norm), NormWeight.of(attn.k_norm))
            if hasattr(attn, "q_norm")
            else (None, None)
        )
        self.act = ACTIVATIONS[type(layer.mlp.act_fn).__name__]
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
        return self._layer(x, cos, sin)[None]

    def _layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.ops.rms_norm(x, self.norms["input_layernorm"])
        attended = self._attention(h, cos, sin)
        residual, h = self.ops.add_rms_norm(x, attended, self.norms["post_attention_layernorm"])
        return residual + self._mlp(h)

    def _attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn, t, d = self.self_attn, h.shape[0], self.head_dim
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q, k = rows_of(q), rows_of(k)
        q_norm, k_norm = self.qk_norms
        self.ops.rotary(q, self.heads, cos, sin, q_norm)
        self.ops.rotary(k, self.kv_heads, cos, sin, k_norm)
        o = attend_tokens(
            q.view(t, self.heads, d),
            k.view(t, self.kv_heads, d),
            v.reshape(t, self.kv_heads, d),
            self.layer_idx,
            self.scaling,
            self.window,
        )
        return attn.o_proj(o.reshape(t, self.heads * d))

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp
        return mlp.down_proj(self.ops.act_mul(mlp.gate_proj(h), mlp.up_proj(h), self.act))


class FusedSandwichLayer(FusedDecoderLayer):
    """Gemma 3's layer: x + post_attn_norm(attention(input_norm(x))) = r, then
    r + post_ff_norm(mlp(pre_ff_norm(r)))."""

    def __init__(self, layer: Any, ops: FusedOps, window: int | None) -> None:
        super().__init__(layer, ops, window)
        for name in _SANDWICH_NORMS:
            setattr(self, name, getattr(layer, name))
            self.norms[name] = NormWeight.of(getattr(layer, name))

    def _layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = self.norms
        h = self.ops.rms_norm(x, n["input_layernorm"])
        attended = self._attention(h, cos, sin)
        residual, h_ff = self.ops.norm_add_rms_norm(
            attended, n["post_attention_layernorm"], x, n["pre_feedforward_layernorm"]
        )
        assert h_ff is not None
        out, _ = self.ops.norm_add_rms_norm(
            self._mlp(h_ff), n["post_feedforward_layernorm"], residual, None
        )
        return out


def _fusable(layer: nn.Module, dtype: torch.dtype) -> bool:
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    name = type(layer).__name__
    if name not in ARCHITECTURES or attn is None or mlp is None:
        return False
    norms = [
        getattr(layer, n, None) for n in _NORMS + (_SANDWICH_NORMS if name in SANDWICH else ())
    ]
    norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
    return (
        all(NormWeight.fusable(n, dtype) for n in norms)
        and len({NormWeight.gemma_style(n) for n in norms}) == 1
        and type(getattr(mlp, "act_fn", None)).__name__ in ACTIVATIONS
        and attn.config._attn_implementation == ATTENTION_NAME
        and getattr(attn, "attn_logit_softcapping", None) is None
        and getattr(attn, "is_causal", True)
        and attn.head_dim % 2 == 0
    )


def why_not_fusable(model: PreTrainedModel) -> str | None:
    """Why this model's decoder layers stay transformers' own (None: they can be fused)."""
    if model.device.type != "cpu" or model.dtype not in DTYPES:
        return f"fused layers run on the CPU in float32 or bfloat16 (here: {model.device}, {model.dtype})"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not all(_fusable(m, model.dtype) for m in layers):
        known = ", ".join(ARCHITECTURES)
        return (
            f"its decoder layers are not one of {known} with RMSNorms, a SiLU or GELU (tanh) "
            "activation and paged attention without soft-capping"
        )
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
        name = type(layer).__name__
        fused = FusedSandwichLayer if name in SANDWICH else FusedDecoderLayer
        base.layers[i] = fused(layer, ops, ARCHITECTURES[name](layer.self_attn))
    if NormWeight.fusable(getattr(base, "norm", None), model.dtype):
        base.norm = FusedRMSNorm(base.norm, ops)
    return len(base.layers)

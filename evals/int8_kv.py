"""A transformers model computing what the engine computes with an int8 KV cache, so a variant
served with `kv_cache_dtype: int8` is scored (lm-eval through HFLM, divergence) as it serves.

Model: the engine stores each key and value as `quantize_int8` codes (per token and KV head),
keys of a layer with a `k_norm` divided by its `key_smoothing` first, and attends over their
dequantized values (`serve/model/kv_cache.py`); this attention rounds the keys and values through
the same functions, then runs transformers' SDPA attention. The
engine's greedy tokens equal `generate`'s over this attention (tests/serve/test_kv_cache_int8.py).
"""

from __future__ import annotations

from typing import Any

INT8_KV_ATTENTION = "workbench_int8_kv_sdpa"


def _int8_kv_attention(module: Any, query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from serve.model.kv_cache import dequantize_int8, key_smoothing, quantize_int8

    def rounded(x: Any, smoothing: Any = None) -> Any:
        return dequantize_int8(*quantize_int8(x, smoothing), x.dtype, smoothing)

    keys = rounded(key, key_smoothing(module))
    return sdpa_attention_forward(module, query, keys, rounded(value), *args, **kw)


def int8_kv_attention() -> str:
    """The attention's name in transformers' registries, registered on first use. It carries
    SDPA's mask function too: transformers builds no mask for a name without one (causal still
    holds through SDPA's `is_causal`, but Gemma 3's sliding windows would be lost)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(INT8_KV_ATTENTION, _int8_kv_attention)
    AttentionMaskInterface.register(INT8_KV_ATTENTION, sdpa_mask)
    return INT8_KV_ATTENTION


def with_kv_cache_dtype(model: Any, kv_cache_dtype: str) -> Any:
    """`model` (a transformers model, or a PEFT model on one) attending as a KV cache of
    `kv_cache_dtype` stores keys and values; `auto` leaves it as it is."""
    if kv_cache_dtype == "int8":
        model.set_attn_implementation(int8_kv_attention())
    elif kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: allowed: auto, int8")
    return model

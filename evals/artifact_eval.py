"""What every variant's manifest records about the loaded model: memory, load time, perplexities.

Perplexity is measured (unless the caller leaves it to the recipe's divergence eval, which
measures it with standard errors: the same forward passes, twice, otherwise) on the demo
corpora's validation splits (the base corpus and the shifted domain), with the variant's own
tokenizer, over the first `EVAL_ROWS` rows of `SEQ_LEN` tokens
(`LARGE_MODEL_ROWS` for models whose embedding has over `LARGE_EMBEDDING` parameters, where 64
rows cost half a minute a variant on 2 cores and the recipe's evals measure the same more
precisely): the same rows for every variant of a base (quantized, adapted, or a student of the
same width), so the figures compare.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from catalog.data import NAMED
from compress import Artifact
from compress.data import load_texts, perplexity, token_rows
from compress.load_model import load_model
from compress.manifest import ArtifactEval

EVAL_ROWS = 64
LARGE_EMBEDDING = 8_000_000
LARGE_MODEL_ROWS = 16
SEQ_LEN = 128


def load_for_eval(artifact: Artifact, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model an artifact describes: the model itself, or an adapter on its base (PEFT);
    float weights (and activations) in `dtype` (None: the model's own, `load_spec.own_dtype`,
    else float32: how the engine loads it by default on the CPU)."""
    if artifact.kind == "adapter":
        from peft import PeftModel

        assert artifact.base is not None, "an adapter artifact names its base"
        base = load_model(artifact.base, dtype=dtype)
        return PeftModel.from_pretrained(base, artifact.path, torch_dtype=base.dtype).eval()
    return load_model(artifact.path, dtype=dtype)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor really holds: the inner tensors of a subclass (torchao's quantized
    tensors report their logical float dtype), plus bitsandbytes' 4-bit block scales."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    total = t.numel() * t.element_size()
    state = getattr(t, "quant_state", None)
    if state is not None and getattr(state, "absmax", None) is not None:
        total += tensor_bytes(state.absmax)
    return total


def memory_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # tied weights once
    return sum(tensor_bytes(t) for t in tensors.values())


def rows_for(model: torch.nn.Module) -> int:
    """Rows scored: fewer for large models, judged by the embedding's size (vocab x hidden from
    the config), which quantization, adapters and layer-dropping students leave unchanged."""
    config: Any = getattr(model, "get_base_model", lambda: model)().config
    large = config.vocab_size * config.hidden_size > LARGE_EMBEDDING
    return LARGE_MODEL_ROWS if large else EVAL_ROWS


def evaluate(artifact: Artifact, perplexity_rows: bool = True) -> ArtifactEval:
    """`perplexity_rows`: score the corpora's rows (else `eval_rows` is 0 and no perplexity)."""
    from transformers import AutoTokenizer

    started = time.perf_counter()
    model = load_for_eval(artifact)
    load_seconds = time.perf_counter() - started
    tok = AutoTokenizer.from_pretrained(artifact.path)
    # sizes first: on the CPU bitsandbytes repacks 4-bit weights at the first forward pass
    measured = {
        "load_seconds": round(load_seconds, 3),
        "bytes_in_memory": memory_bytes(model),
        "parameters_loaded": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for n, p in model.named_parameters() if "lora_" in n),
        "eval_rows": rows_for(model) if perplexity_rows else 0,
        "eval_seq_len": SEQ_LEN,
    }
    for name in ("corpus", "shift") if perplexity_rows else ():
        rows = token_rows(tok, load_texts(name, "validation", NAMED), SEQ_LEN)[: rows_for(model)]
        measured[f"perplexity_{name}"] = perplexity(model, rows)
    return ArtifactEval.model_validate(measured)

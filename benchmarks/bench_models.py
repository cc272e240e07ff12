"""The models the engine benchmarks run: a 25M random Llama (built once, on the demo model's
tokenizer) and transformers' own model as the baseline; the engine's default block size."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from compress.load_model import load_model
from serve.core.config import CacheConfig

DEFAULT_BLOCK_SIZE = CacheConfig().block_size


def random_llama_25m(tokenizer_dir: Path, out: Path) -> Path:
    """A ~25M-parameter Llama (hidden 512, 8 layers, GQA 8/4) with random weights."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=512,
        intermediate_size=1280,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def default_llama_25m() -> Path:
    """The 25M random Llama in the temp dir (built once, on the demo model's tokenizer): the
    default model of the small engine benchmarks."""
    import tempfile

    from catalog import ensure_demo_model

    scratch = Path(tempfile.gettempdir()) / "workbench-llama-25m"
    return random_llama_25m(ensure_demo_model("demo"), scratch)


def load_baseline_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """transformers' own model with SDPA attention: the baseline of the engine benchmarks (a
    packed variant with its packed modules, as the engine loads it)."""
    return load_model(model_dir, dtype=dtype, attn_implementation="sdpa")

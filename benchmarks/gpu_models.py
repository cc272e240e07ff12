"""The models of the GPU decode table (`benchmarks.gpu_decode_table`): hand-written configs of
the engine benchmarks' 25M Llama, Llama-3.2-1B and Llama-3.1-8B (nothing downloaded), their
dry-run sizes, random bfloat16 weights initialised on the device, a synthetic tokenizer of the
model's vocabulary, and an RTN int4 copy built in memory by the `rtn` method's own code.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

from compress.calibrated import RTNParams, quantized_linears
from compress.grids import rtn
from compress.packed_modules import packed_module


def llama_25m() -> PretrainedConfig:
    from transformers import AutoConfig

    from benchmarks.bench_models import default_llama_25m

    return AutoConfig.from_pretrained(default_llama_25m())


def _llama3(**sizes: Any) -> LlamaConfig:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    rope["factor"] = sizes.pop("rope_factor")
    return LlamaConfig(
        vocab_size=128256,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        bos_token_id=128000,
        eos_token_id=128001,
        **sizes,
    )


def llama_3_2_1b() -> LlamaConfig:
    """meta-llama/Llama-3.2-1B's shapes (1.24B parameters, tied embeddings)."""
    return _llama3(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        head_dim=64,
        tie_word_embeddings=True,
        rope_factor=32.0,
    )


def llama_3_1_8b() -> LlamaConfig:
    """meta-llama/Llama-3.1-8B's shapes (8.03B parameters)."""
    return _llama3(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        head_dim=128,
        tie_word_embeddings=False,
        rope_factor=8.0,
    )


MODELS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-25m": llama_25m,
    "llama-3.2-1b": llama_3_2_1b,
    "llama-3.1-8b": llama_3_1_8b,
}


def tiny(config: PretrainedConfig) -> PretrainedConfig:
    """`config` at a dry run's size (2 layers, hidden 128, vocabulary 512), its kind kept."""
    small = copy.deepcopy(config)
    sizes = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
    sizes |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    sizes |= {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    for name, value in sizes.items():
        setattr(small, name, value)
    return small


def synthetic_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer `t0 .. t{vocab_size - 1}`: the engine detokenizes what it samples."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t2")


def build_model(config: PretrainedConfig, device: torch.device) -> PreTrainedModel:
    """Random bfloat16 weights initialised on `device`, SDPA attention."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def rtn_int4(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of `model` whose decoder linears are RTN int4 packed modules (the `rtn` method's
    defaults: groups of 128, asymmetric, lm_head kept), as a packed artifact loads them."""
    params = RTNParams(method="rtn")
    quantized = copy.deepcopy(model)
    names = {n for n, _ in quantized.named_modules() if n not in params.ignore}
    with torch.no_grad():
        for name, linear in quantized_linears(quantized, names).items():
            codes = rtn(linear.weight, params.format, params.sym)
            module = packed_module(params.format, codes, linear.bias, model.dtype)
            quantized.set_submodule(name, module)
    return quantized

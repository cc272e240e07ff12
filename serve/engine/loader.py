"""The served model, resolved and made ready once, before the engine sizes anything.

Model: `load_for_serving` resolves the device and dtype, loads the model and its tokenizer (or
takes them already loaded), and applies what the configuration asks of the model itself: on
the CPU, glibc's malloc told to keep freed memory, linears prepacked for oneDNN and
bitsandbytes layers swapped for the engine's kernels; decoder layers fused; `--compile`
checked against the model. The engine then builds its runner, scheduler and sampler around the
`LoadedModel` without deciding any of this again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from serve.core.config import ModelConfig
from serve.model.bnb_linear import replace_bnb_linears
from serve.model.compilation import why_not_compilable
from serve.model.cpu_linear import prepack_linears
from serve.model.fused_layers import fuse_decoder_layers
from serve.model.host_memory import keep_freed_memory
from serve.model.model_runner import load_model, resolve_device, resolve_dtype


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    vocab_size: int
    """Rows of the model's head (may exceed the tokenizer's length: padding rows)."""


def load_for_serving(
    config: ModelConfig,
    loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase] | None = None,
    lora: bool = False,
) -> LoadedModel:
    """The model of `config` (or `loaded`, on its own device), ready for the engine; raises
    ValueError naming a setting that cannot serve it (`--compile` with LoRA, say)."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, config.model)
    if device.type == "cpu":
        keep_freed_memory()
    model, tokenizer = loaded or (
        load_model(config, device, dtype),
        AutoTokenizer.from_pretrained(config.model),
    )
    vocab_size = model.get_output_embeddings().out_features
    prepare(model, config, device, lora)
    return LoadedModel(model, tokenizer, device, vocab_size)


def prepare(model: PreTrainedModel, config: ModelConfig, device: torch.device, lora: bool) -> None:
    """Prepack, swap and fuse the model's layers as `config` says; check `--compile`."""
    if config.prepack_linears and device.type == "cpu":
        prepack_linears(model, merge_groups=config.merge_projections)
        replace_bnb_linears(model)
    if config.fuse_layers and not config.compile:  # CPU models only: why_not_fusable
        fuse_decoder_layers(model)
    if config.compile and (why_not := why_not_compilable(model, lora)):
        raise ValueError(f"--compile cannot be used here: {why_not}; drop --compile")

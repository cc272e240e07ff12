"""Calibration for weight quantization: token windows from the recipe's data, and a layer-by-layer
pass over the decoder that lets a method see each layer's real inputs.

Model: the calibration set is `samples` windows of `seq_len` tokens, drawn (seeded) from the
train split of a named data set or a local file; its sha256 identifies it in the manifest.
`run_layerwise` runs the model once to record the first decoder layer's inputs and every layer's
call arguments (masks, rotary embeddings: they differ between sliding and global layers), then
visits the layers in order: `visit(index, layer, inputs, kwargs)` may change the layer's weights
(quantize them), and the layer's outputs on those new weights become the next layer's inputs, so
each layer is calibrated on what the already-quantized layers below it produce.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field
from torch import nn

from compress.data import DataCatalog, load_texts, token_rows
from compress.registry import StepParams

Batch = tuple[torch.Tensor, dict[str, Any]]
"""One calibration batch at a layer: its hidden states and the layer's keyword arguments."""
Visit = Callable[[int, nn.Module, list[Batch]], None]


class CalibrationParams(StepParams):
    data: str = "corpus"
    """A named data set or a local .jsonl / .json / .txt file; its train split is used."""
    samples: int = Field(default=64, ge=1, le=4096)
    """Windows drawn from the data."""
    seq_len: int = Field(default=512, ge=16, le=8192)
    """Tokens per window."""
    batch_size: int = Field(default=8, ge=1, le=256)
    """Windows per forward pass."""


@dataclass(frozen=True)
class Calibration:
    rows: torch.Tensor
    """[samples, seq_len] token ids."""
    sha256: str

    def record(self, params: CalibrationParams) -> dict[str, Any]:
        return {**params.model_dump(), "tokens": self.rows.numel(), "sha256": self.sha256}


def calibration_rows(
    tokenizer: Any, params: CalibrationParams, catalog: DataCatalog, seed: int
) -> Calibration:
    """Seeded windows of the data's train split (evals read the validation split)."""
    rows = token_rows(tokenizer, load_texts(params.data, "train", catalog), params.seq_len)
    if len(rows) < params.samples:
        raise ValueError(
            f"calibration data {params.data!r} holds {len(rows)} windows of {params.seq_len} "
            f"tokens, fewer than samples: {params.samples}; lower samples or seq_len"
        )
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    chosen = rows[order[: params.samples].sort().values].contiguous()
    return Calibration(chosen, hashlib.sha256(chosen.numpy().tobytes()).hexdigest())


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no `model.layers`; calibrated quantization supports "
            "decoder-only models laid out as transformers' Llama, Qwen and Gemma are"
        )
    return layers


class _Stop(Exception):
    pass


def _layer_output(layer: nn.Module, batch: Batch) -> torch.Tensor:
    out = layer(batch[0], **batch[1])
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def record_inputs(model: nn.Module, rows: torch.Tensor, batch_size: int) -> list[list[Batch]]:
    """Per layer, per batch: (hidden states, kwargs); only layer 0's hidden states are real
    (later layers' are filled in by `run_layerwise`)."""
    layers = decoder_layers(model)
    recorded: list[list[Batch]] = [[] for _ in layers]

    def hook(index: int) -> Callable[..., None]:
        def record(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs.pop("hidden_states")
            kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            recorded[index].append((hidden if index == 0 else torch.empty(0), kwargs))
            if index == len(layers) - 1:
                raise _Stop

        return record

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(layers)]
    try:
        for start in range(0, len(rows), batch_size):
            with contextlib.suppress(_Stop):
                model(input_ids=rows[start : start + batch_size], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return recorded


def layer_prefix(model: nn.Module, layer: nn.Module) -> str:
    """The module name of `layer` inside `model` (`model.layers.3`)."""
    return next(n for n, m in model.named_modules() if m is layer)


def run_with_input_hooks(
    layer: nn.Module, batches: list[Batch], hooks: dict[str, Callable[[torch.Tensor], None]]
) -> None:
    """Run `layer` on every batch, giving each named submodule's input to its hook."""
    handles = [
        layer.get_submodule(name).register_forward_pre_hook(lambda _m, args, f=f: f(args[0]))
        for name, f in hooks.items()
    ]
    try:
        for x, kw in batches:
            layer(x, **kw)
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def run_layerwise(model: nn.Module, rows: torch.Tensor, batch_size: int, visit: Visit) -> None:
    """Visit every decoder layer with its calibration inputs (see the module doc)."""
    recorded = record_inputs(model, rows, batch_size)
    inputs = [hidden for hidden, _ in recorded[0]]
    for index, layer in enumerate(decoder_layers(model)):
        batches = [(x, kw) for x, (_, kw) in zip(inputs, recorded[index])]
        visit(index, layer, batches)
        inputs = [_layer_output(layer, b) for b in batches]

"""Writing and reading packed checkpoints (the `packed` format of `compress.load_spec`).

Contract: `save_packed` writes config.json, generation_config.json, one model.safetensors (the
float tensors of everything not packed, and `<module>.qweight/.scales/.zeros` of each packed
module) and `workbench_packed.json`; `load_packed` rebuilds the transformers model from the
config without initialising weights, swaps in the packed modules, and loads every stored tensor,
refusing a checkpoint with tensors missing or left over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from compress.load_spec import PACKED, PACKED_VERSION, LoadSpec
from compress.packed import PackedFormat, Quantized, pack_codes, unpack_codes
from compress.packed_modules import packed_embedding, packed_module

WEIGHTS = "model.safetensors"
SUFFIXES = ("qweight", "scales", "zeros")


@dataclass(frozen=True)
class PackedModel:
    """What a calibrated method made: the float model (packed modules' weights ignored) and,
    per packed module, its format and codes."""

    model: Any
    modules: dict[str, tuple[PackedFormat, Quantized]]
    embeddings: tuple[PackedFormat, Quantized] | None = None
    """The input embedding's format and codes (a tied lm_head reads them too)."""


def _embedding_name(model: Any) -> str:
    embed = model.get_input_embeddings()
    return next(n for n, m in model.named_modules() if m is embed)


def _tied(model: Any) -> bool:
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def save_packed(packed: PackedModel, out: Path, record: dict[str, Any]) -> None:
    model = packed.model
    embed_name = _embedding_name(model)
    skip = {f"{n}.weight" for n in packed.modules}
    if packed.embeddings is not None:
        skip.add(f"{embed_name}.weight")
    if _tied(model):
        skip.add("lm_head.weight")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in skip}
    coded = dict(packed.modules)
    if packed.embeddings is not None:
        coded[embed_name] = packed.embeddings
    for name, (fmt, qw) in coded.items():
        state[f"{name}.qweight"] = pack_codes(qw.q, fmt.bits)
        state[f"{name}.scales"], state[f"{name}.zeros"] = qw.scales, qw.zeros
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    meta = {
        "format": "packed",
        "version": PACKED_VERSION,
        **record,
        "modules": {n: fmt.name for n, (fmt, _) in sorted(packed.modules.items())},
        "embeddings": packed.embeddings[0].name if packed.embeddings is not None else None,
        "tied": _tied(model),
    }
    (out / PACKED).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the dir's `model.safetensors`."""
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a mapping)


def take_quantized(
    state: dict[str, torch.Tensor], name: str, bits: int, device: torch.device
) -> Quantized:
    try:
        q, scales, zeros = (state.pop(f"{name}.{s}") for s in SUFFIXES)
    except KeyError as e:
        raise ValueError(f"packed checkpoint lacks {e.args[0]}; rebuild the variant") from None
    return Quantized(unpack_codes(q, bits).to(device), scales.to(device), zeros.to(device))


def load_packed(
    spec: LoadSpec, dtype: torch.dtype, device: torch.device, extra: dict[str, Any]
) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(spec.path)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    state = read_tensors(spec.path)
    for name, fmt_name in spec.module_formats.items():
        fmt = PackedFormat.parse(fmt_name)
        old = model.get_submodule(name)
        qw = take_quantized(state, name, fmt.bits, device)
        bias = state.pop(f"{name}.bias", None)
        model.set_submodule(name, packed_module(fmt, qw, bias, dtype))
        del old
    embed_fmt = stored_embedding_format(spec)
    embed_name = _embedding_name(model)
    embedding = (
        (embed_fmt, take_quantized(state, embed_name, embed_fmt.bits, device))
        if embed_fmt
        else None
    )
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {f"{embed_name}.weight"} if embedding else set()
    missing = [k for k in missing if k not in allowed and not _is_tied_head(model, k)]
    if missing or unexpected:
        raise ValueError(
            f"{spec.path / WEIGHTS}: tensors missing {missing[:5]} or unexpected "
            f"{unexpected[:5]}; the checkpoint does not match its config: rebuild the variant"
        )
    if embedding is not None:
        _install_embeddings(model, *embedding, dtype, bool(spec.params.get("tied")))
    else:
        model.tie_weights()  # NOTE: from_config without weight init leaves a tied head unset
    return model.to(device)


def _is_tied_head(model: Any, key: str) -> bool:
    return key == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def stored_embedding_format(spec: LoadSpec) -> PackedFormat | None:
    """The packed embedding's format (`embeddings` in the packed manifest), None when float."""
    name = spec.params.get("embeddings")
    return PackedFormat.parse(name) if name else None


def _install_embeddings(
    model: Any, fmt: PackedFormat, qw: Quantized, dtype: torch.dtype, tied: bool
) -> None:
    name = _embedding_name(model)
    old = model.get_submodule(name)
    embedding = packed_embedding(fmt, qw, dtype, getattr(old, "embed_scale", None))
    model.set_submodule(name, embedding)
    if tied:  # the head reads the same codes: one copy in memory
        model.set_submodule("lm_head", embedding.linear)
        # tied already: transformers' `tie_weights()` (lm-eval's HFLM calls it) would look for
        # a float `embed_tokens.weight` that the packed lookup does not have
        model._tied_weights_keys = None
        model.all_tied_weights_keys = {}

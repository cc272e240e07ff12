"""Reading compressed-tensors `pack-quantized` checkpoints (ours from `compress.export`, or
llm-compressor's) as dense float weights.

Model: each config group names its modules (`targets`: names, `re:` patterns or class names)
and their weight scheme; a module's `weight_packed`, `weight_scale`, `weight_zero_point` and
`weight_shape` are decompressed by the package's own compressor with that module's scheme.
transformers 5.24 cannot do this for every checkpoint: its dequantizing route applies the first
config group's scheme to every dense module (a mixed plan has several), and its plain route
drops asymmetric zero points (it allocates them unpacked); this reader does both right.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def _scheme_of(name: str, groups: dict[str, Any], classes: dict[str, str]) -> Any:
    for scheme in groups.values():
        for target in scheme.targets:
            if target.startswith("re:"):
                if re.match(target[3:], name):
                    return scheme
            elif target in (name, classes.get(name)):
                return scheme
    raise ValueError(f"no config group of the quantization_config targets {name}")


def dense_state(path: Path, config: dict[str, Any], classes: dict[str, str]) -> dict[str, Any]:
    """Every tensor of the checkpoint at `path`, packed modules decompressed to `<m>.weight`
    (float32); `classes`: module name -> class name, for targets that name a class."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    if config.get("format") != "pack-quantized":
        raise ValueError(
            f"{path}: compressed-tensors format {config.get('format')!r}; this reader takes "
            "pack-quantized (int4 / int8 weight-only) checkpoints"
        )
    groups = QuantizationConfig.model_validate(config).config_groups
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    modules = sorted({k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_packed")})
    for name in modules:
        scheme = _scheme_of(name, groups, classes)
        parts = {s: state.pop(f"{name}.{s}") for s in SUFFIXES if f"{name}.{s}" in state}
        dense = PackedQuantizationCompressor.decompress(parts, scheme)
        state[f"{name}.weight"] = dense["weight"].float()
    return state


def load_dense(path: Path, dtype: torch.dtype, extra: dict[str, Any]) -> Any:
    """The transformers model of a pack-quantized checkpoint, its weights dense in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(path)
    quant = config.quantization_config
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    del config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    classes = {n: type(m).__name__ for n, m in model.named_modules()}
    state = dense_state(path, quant, classes)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"{path}: tensors missing {missing[:5]} or unexpected {unexpected[:5]}; the "
            "checkpoint does not match its config"
        )
    model.tie_weights()
    return model.to(dtype)

"""Reading a PEFT LoRA adapter directory into per-module (A, B, scaling), refusing what won't fit.

Contract: `load_adapter(path, targets, max_rank)` returns the adapter's weights for each module it
adapts, or raises `AdapterError` naming the problem and the fix: missing dir, not a PEFT LoRA
adapter, pickle weights (only safetensors are read), corrupt safetensors, rank over the server's
maximum, a module the model does not have, or shapes made for another base. `rank_pattern` and
`alpha_pattern` (per-module overrides, matched by suffix or regex as PEFT does) and rsLoRA
scaling (alpha / sqrt(r)) are honoured.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be loaded; the message names the problem and the fix."""


@dataclass(frozen=True)
class LoraWeights:
    a: torch.Tensor
    """[r, in_features]"""
    b: torch.Tensor
    """[out_features, r]"""
    scaling: float


@dataclass(frozen=True)
class Adapter:
    path: Path
    rank: int
    """The largest rank over its modules."""
    modules: dict[str, LoraWeights]


def _pattern_value(module: str, pattern: dict[str, float], default: float) -> float:
    """PEFT's rule: a key matches a module whose name ends with it (or fully matches it as a regex)."""
    for key, value in pattern.items():
        if module == key or module.endswith("." + key) or re.fullmatch(key, module):
            return value
    return default


def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise AdapterError(f"{path}: no such directory; give the path of a PEFT adapter dir")
    if not (path / CONFIG).is_file():
        raise AdapterError(
            f"{path}: no {CONFIG}; this is not a PEFT adapter dir (save it with PeftModel.save_pretrained)"
        )
    try:
        config = json.loads((path / CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path / CONFIG}: not valid JSON ({e})") from None
    if config.get("peft_type") != "LORA":
        raise AdapterError(
            f"{path}: peft_type is {config.get('peft_type')!r}; only LORA adapters are served"
        )
    for field, neutral in (("bias", "none"), ("fan_in_fan_out", False), ("use_dora", False)):
        if config.get(field, neutral) not in (neutral, None):
            raise AdapterError(
                f"{path}: {field}={config[field]!r} is not supported; train with {field}={neutral!r}"
            )
    if config.get("modules_to_save"):
        raise AdapterError(f"{path}: modules_to_save {config['modules_to_save']} is not supported")
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if not (path / WEIGHTS).is_file():
        others = sorted(
            p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")
        )
        if others:
            raise AdapterError(
                f"{path}: weights are in {others[0]} (pickle); only {WEIGHTS} is read, "
                "re-save with safe_serialization=True"
            )
        raise AdapterError(f"{path}: no {WEIGHTS}")
    try:
        return load_file(str(path / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterError(f"{path / WEIGHTS}: not a readable safetensors file ({e})") from None


def load_adapter(path: Path, shapes: dict[str, tuple[int, int]], max_rank: int) -> Adapter:
    """`shapes`: adaptable module name -> (in_features, out_features) of the served model."""
    config = read_config(path)
    tensors = _read_weights(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(
                f"{path / WEIGHTS}: unexpected tensor {key!r}; not a PEFT LoRA state dict"
            )
        pairs.setdefault(match["module"], {})[match["which"]] = tensor.float()
    if not pairs:
        raise AdapterError(f"{path / WEIGHTS}: no LoRA tensors")
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    modules = {}
    for module, ab in sorted(pairs.items()):
        modules[module] = _module_weights(path, module, ab, config, shapes, max_rank, r, alpha)
    return Adapter(path, max(w.a.shape[0] for w in modules.values()), modules)


def _module_weights(
    path: Path,
    module: str,
    ab: dict[str, torch.Tensor],
    config: dict,
    shapes: dict[str, tuple[int, int]],
    max_rank: int,
    r: int,
    alpha: float,
) -> LoraWeights:
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"{path}: module {module} has lora_{'A' if 'A' in ab else 'B'} only")
    if module not in shapes:
        close = [m for m in shapes if m.rsplit(".", 1)[-1] == module.rsplit(".", 1)[-1]][:3]
        hint = f" (this model has e.g. {', '.join(close)})" if close else ""
        raise AdapterError(
            f"{path}: targets module {module!r}, which this model does not have{hint}; "
            "the adapter was made for another base"
        )
    a, b = ab["A"], ab["B"]
    in_features, out_features = shapes[module]
    if a.shape[1] != in_features or b.shape[0] != out_features or a.shape[0] != b.shape[1]:
        raise AdapterError(
            f"{path}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but the model's layer is "
            f"{in_features} -> {out_features}; the adapter was made for another base"
        )
    rank = a.shape[0]
    if rank > max_rank:
        raise AdapterError(
            f"{path}: rank {rank} ({module}) is over the server's maximum of {max_rank}; "
            "restart with a larger --max-lora-rank"
        )
    module_r = _pattern_value(module, config.get("rank_pattern") or {}, r)
    module_alpha = _pattern_value(module, config.get("alpha_pattern") or {}, alpha)
    scale = (
        module_alpha / math.sqrt(module_r) if config.get("use_rslora") else module_alpha / module_r
    )
    return LoraWeights(a, b, scale)

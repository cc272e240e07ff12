"""Reading a PEFT LoRA adapter directory into per-module (A, B, scaling), refusing what won't fit.

Contract: `load_adapter(path, targets, max_rank)` returns the adapter's weights for each module it
adapts, or raises `AdapterError` naming the problem and the fix: missing dir, not a PEFT LoRA
adapter, pickle weights (only safetensors are read), corrupt safetensors, rank over the server's
maximum, a module the model does not have, or shapes made for another base. `rank_pattern` and
`alpha_pattern` (per-module overrides, matched by suffix or regex as PEFT does) and rsLoRA
scaling (alpha / sqrt(r)) are honoured.

NOTE: everything the engine step will do with the adapter is checked here, off the engine
thread, so an adapter that loads can never fail a step: config types and ranges, tensor ranks
and shapes, finite weights, a scaling that stays finite in the served dtype, pattern keys that
compile and match in bounded time, and (with `root`) every file resolving inside the root.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from compress.artifact import MANIFEST, check_intact
from serve.lora.registry import AdapterError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


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


MAX_PATTERN_KEYS, MAX_PATTERN_CHARS = 4096, 1024
PATTERN_SECONDS = 0.05
"""Time allowed to match one pattern key against one module name (regex's own timeout)."""


def _pattern_value(module: str, pattern: dict[str, float], default: float) -> float:
    """PEFT's rule (`get_pattern_key`): the first key that, as a regex, matches the end of the
    module name after a dot boundary, `(.*\\.)?(key)$`. Matched with the `regex` module under a
    timeout and without holding the GIL, so a pathological key costs at most PATTERN_SECONDS."""
    for key, value in pattern.items():
        try:
            hit = regex.match(rf"(.*\.)?({key})$", module, timeout=PATTERN_SECONDS, concurrent=True)
        except TimeoutError:
            raise AdapterError(
                f"pattern key {key[:80]!r} took over {PATTERN_SECONDS} s to match {module!r}; "
                "use plain module-name suffixes (e.g. 'q_proj' or 'layers.0.self_attn.q_proj')"
            ) from None
        if hit:
            return value
    return default


def _resolved_inside(file: Path, root: Path | None) -> Path:
    """`file` with symlinks resolved; refused when it leaves `root` (checked before reading)."""
    try:
        resolved = file.resolve(strict=True)
    except (OSError, RuntimeError) as e:
        raise AdapterError(f"{file}: cannot be opened ({e})") from None
    if root is not None and not resolved.is_relative_to(root.resolve()):
        raise AdapterError(
            f"{file} resolves to {resolved}, outside the adapter root {root}; "
            "adapter files (and their symlinks) must stay inside it"
        )
    return resolved


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_pattern(path: Path, name: str, pattern: Any, is_value: Any, wanted: str) -> None:
    if pattern is None:
        return
    if not isinstance(pattern, dict):
        raise AdapterError(
            f"{path / CONFIG}: {name} is a {type(pattern).__name__}; it must be an object "
            f"{{module name or regex: {wanted}}}"
        )
    if len(pattern) > MAX_PATTERN_KEYS:
        raise AdapterError(f"{path / CONFIG}: {name} has over {MAX_PATTERN_KEYS} keys")
    for key, value in pattern.items():
        if len(key) > MAX_PATTERN_CHARS:
            raise AdapterError(f"{path / CONFIG}: a {name} key is over {MAX_PATTERN_CHARS} chars")
        try:
            regex.compile(key)
        except regex.error as e:
            raise AdapterError(
                f"{path / CONFIG}: {name} key {key!r} is not a valid regex ({e})"
            ) from None
        if not is_value(value):
            raise AdapterError(
                f"{path / CONFIG}: {name}[{key!r}] is {value!r}; it must be {wanted}"
            )


def _check_numbers(path: Path, config: dict[str, Any]) -> None:
    """r, lora_alpha, use_rslora and the patterns, as PEFT would read them."""
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if not _is_rank(r):
        raise AdapterError(f"{path / CONFIG}: r is {r!r}; it must be an integer >= 1")
    if not _is_number(alpha):
        raise AdapterError(f"{path / CONFIG}: lora_alpha is {alpha!r}; it must be a finite number")
    if not isinstance(config.get("use_rslora", False), bool):
        raise AdapterError(f"{path / CONFIG}: use_rslora must be true or false")
    _check_pattern(path, "rank_pattern", config.get("rank_pattern"), _is_rank, "an integer >= 1")
    _check_pattern(
        path, "alpha_pattern", config.get("alpha_pattern"), _is_number, "a finite number"
    )


def read_config(path: Path, root: Path | None = None) -> dict:
    try:
        if not path.is_dir():
            raise AdapterError(f"{path}: no such directory; give the path of a PEFT adapter dir")
        if not (path / CONFIG).is_file():
            raise AdapterError(
                f"{path}: no {CONFIG}; this is not a PEFT adapter dir (save it with PeftModel.save_pretrained)"
            )
        config = json.loads(_resolved_inside(path / CONFIG, root).read_text())
    except AdapterError:
        raise
    except json.JSONDecodeError as e:
        raise AdapterError(f"{path / CONFIG}: not valid JSON ({e})") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path, undecodable bytes
        raise AdapterError(f"{str(path)[:200]}: cannot be read ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise AdapterError(
            f"{path / CONFIG}: holds a JSON {type(config).__name__}, not an object; "
            "this is not a PEFT adapter config"
        )
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
    _check_numbers(path, config)
    return config


def _read_weights(path: Path, root: Path | None) -> dict[str, torch.Tensor]:
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
    file = _resolved_inside(path / WEIGHTS, root)
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterError(f"{path / WEIGHTS}: not a readable safetensors file ({e})") from None


def load_adapter(
    path: Path,
    shapes: dict[str, tuple[int, int]],
    max_rank: int,
    root: Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> Adapter:
    """`shapes`: adaptable module name -> (in_features, out_features) of the served model;
    `root`: when given, every file read must resolve inside it; `dtype`: the served dtype, in
    which the scaled weights must stay finite."""
    config = read_config(path, root)
    try:
        if (path / MANIFEST).exists():
            _resolved_inside(path / MANIFEST, root)
        check_intact(path)
    except ValueError as e:
        raise AdapterError(str(e)) from None
    tensors = _read_weights(path, root)
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
        _check_finite(path, module, modules[module], dtype)
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
    if a.dim() != 2 or b.dim() != 2:
        raise AdapterError(
            f"{path}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; LoRA matrices "
            "are 2-D ([r, in] and [out, r])"
        )
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


def _check_finite(path: Path, module: str, w: LoraWeights, dtype: torch.dtype) -> None:
    """The engine stores A and B * scaling in `dtype`: each must be finite there."""
    limit = torch.finfo(dtype).max
    if not math.isfinite(w.scaling) or abs(w.scaling) > limit:
        raise AdapterError(
            f"{path}: {module}'s scaling (lora_alpha / r) is {w.scaling!r}, which {dtype} cannot "
            "hold; use a smaller lora_alpha"
        )
    for name, tensor in (("lora_A", w.a), ("lora_B x scaling", w.b * w.scaling)):
        if not bool(torch.isfinite(tensor.to(dtype)).all()):
            raise AdapterError(
                f"{path}: {module}'s {name} has NaN or infinite values in {dtype}; "
                "the adapter's weights (or its lora_alpha) are broken: retrain or re-save it"
            )

"""What a model dir's config alone says about the model (no weights loaded): its module names,
its parameter count, the most positions it encodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.artifact import count_parameters


def _meta_model(model_dir: Path) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.quantization_config = None  # the architecture only
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def position_limit(model_dir: Path) -> int | None:
    """The most positions the model in `model_dir` encodes, from its config (None: unstated)."""
    from transformers import AutoConfig

    from serve.model.model_runner import config_position_limit

    return config_position_limit(AutoConfig.from_pretrained(model_dir))


def module_names(model_dir: Path) -> list[str]:
    """Module names of the model in `model_dir`, from its config alone (no weights loaded)."""
    return [n for n, _ in _meta_model(model_dir).named_modules()]


def parameter_count(kind: str, path: Path) -> int:
    """A model's parameters as its architecture defines them (a quantized weight counts as many
    parameters as the float one it replaces); an adapter's stored tensor elements."""
    if kind == "adapter":
        return count_parameters(path)
    return sum(p.numel() for p in _meta_model(path).parameters())

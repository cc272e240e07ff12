"""Built-in model names: what `demo`, `smollm2-135m` or a `.gguf` path stands for."""

from __future__ import annotations

from pathlib import Path

from catalog.cache import ensure_demo_model
from catalog.gguf_base import NAMED_GGUF, ensure_gguf_model, named_gguf_path
from catalog.train import SPECS


def named_model_dir(value: str) -> Path | None:
    """The model dir behind a built-in name (`demo`, `smollm2-135m`) or a `.gguf` file, built or
    converted on first use; None when `value` is neither (a model dir or hub id)."""
    if value in SPECS:
        return ensure_demo_model(value)
    if value in NAMED_GGUF:
        return ensure_gguf_model(named_gguf_path(value))
    if value.endswith(".gguf") and Path(value).expanduser().is_file():
        return ensure_gguf_model(Path(value).expanduser().resolve())
    return None

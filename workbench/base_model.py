"""What a recipe's `base` names, and how it becomes the first artifact of every variant.

`demo` / `demo-tiny` are the built-in offline models; `smollm2-135m` (and any `.gguf` file) is a
GGUF model converted once into the cache (`catalog.gguf_base`); an existing directory (absolute, or relative
to the recipe file, or to the working dir) is a local HF model; `org/name` is a hub id, fetched
through the HF cache (offline use needs it cached, and `HF_HUB_OFFLINE=1` then avoids the network).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from catalog.cache import demo_model_dir, ensure_demo_model, spec_hash
from catalog.gguf_base import (
    CONVERT_VERSION,
    GGUF_INFO,
    NAMED_GGUF,
    ensure_gguf_model,
    gguf_model_dir,
    gguf_sha256,
    named_gguf_path,
)
from catalog.names import named_model_dir
from catalog.train import SPECS
from compress.artifact import Artifact
from compress.content_hash import sha256_cached

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class BaseRef:
    kind: Literal["demo", "gguf", "local", "hub"]
    name: str
    """Demo spec name, resolved absolute path (of a model dir or a GGUF file), or hub id."""


def resolve_base(value: str, recipe_dir: Path) -> BaseRef:
    """Classify `value`; raise ValueError (naming what is allowed) when it names nothing."""
    if value in SPECS:
        return BaseRef("demo", value)
    if value in NAMED_GGUF:
        return BaseRef("gguf", str(named_gguf_path(value)))
    candidate = Path(value).expanduser()
    for root in [recipe_dir, Path.cwd()]:
        path = (root / candidate).resolve()  # an absolute candidate ignores root
        if path.is_file() and path.suffix == ".gguf":
            return BaseRef("gguf", str(path))
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ValueError(
                    f"found directory {str(path)!r} with no config.json; a local base must be "
                    "a Hugging Face model dir (written by save_pretrained)"
                )
            return BaseRef("local", str(path))
    if _HUB_ID.match(value) and not value.startswith((".", "/", "~")):
        return BaseRef("hub", value)
    allowed = ", ".join([*SPECS, *NAMED_GGUF])
    raise ValueError(
        f"found {value!r}: no such directory (looked relative to {recipe_dir} and the working "
        f"dir); allowed: {allowed}, an existing local model dir or .gguf file, or a hub id "
        "'org/name'"
    )


def base_fingerprint(ref: BaseRef) -> str:
    """Identifies the base's content: a changed base invalidates every variant built on it. A
    local base is identified by the sha256 of every file (cached by path, size and mtime)."""
    if ref.kind == "demo":
        payload = f"demo:{ref.name}:{spec_hash(SPECS[ref.name])}"
    elif ref.kind == "gguf":
        payload = f"gguf:{gguf_sha256(Path(ref.name))}:{CONVERT_VERSION}"
    elif ref.kind == "hub":
        payload = f"hub:{ref.name}:{Path(_hub_snapshot(ref.name)).name}"
    else:
        root = Path(ref.name)
        paths = sorted(p for p in root.rglob("*") if p.is_file() and not _hidden(p, root))
        hashes = sha256_cached(paths)
        files = [(p.relative_to(root).as_posix(), hashes[p]) for p in paths]
        payload = json.dumps(["content", files])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _hidden(path: Path, root: Path) -> bool:
    """Dot files and dirs (.cache, .git) are not part of a model's content."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _hub_snapshot(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
    return snapshot_download(repo_id, allow_patterns=patterns)


def base_dir_if_present(ref: BaseRef) -> Path | None:
    """The base's model dir when it is at hand without building or downloading anything."""
    if ref.kind == "demo":
        path = demo_model_dir(ref.name)
        return path if path.is_dir() else None
    if ref.kind == "gguf":
        path = gguf_model_dir(Path(ref.name))
        return path if (path / GGUF_INFO).is_file() else None
    if ref.kind == "local":
        return Path(ref.name)
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref.name, local_files_only=True))
    except Exception:  # not cached (or the hub library cannot tell): nothing at hand
        return None


def base_artifact(ref: BaseRef) -> Artifact:
    """The base as an artifact dir, building the demo model or fetching the hub snapshot."""
    if ref.kind == "demo":
        return Artifact(ensure_demo_model(ref.name))
    if ref.kind == "gguf":
        return Artifact(ensure_gguf_model(Path(ref.name)))
    if ref.kind == "hub":
        return Artifact(Path(_hub_snapshot(ref.name)))
    return Artifact(Path(ref.name))


__all__ = [
    "BaseRef",
    "base_artifact",
    "base_dir_if_present",
    "base_fingerprint",
    "demo_model_dir",
    "named_model_dir",
    "resolve_base",
]

"""Artifacts: directories a step writes, each with a `workbench.json` manifest.

Contract: an artifact directory either does not exist or is complete. Writers build it under a
hidden temporary sibling (`.NAME.tmp-PID`) and rename it into place only when done; readers (the
pipeline, the server) trust any directory whose manifest exists. This module is also the metadata
format the server reads, so it imports neither the pipeline nor the steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from safetensors import safe_open

MANIFEST = "workbench.json"
ArtifactKind = Literal["model", "adapter"]


@dataclass(frozen=True)
class Artifact:
    """A model directory (HF `save_pretrained` layout) or a PEFT adapter directory."""

    path: Path
    kind: ArtifactKind = "model"
    info: dict[str, Any] = field(default_factory=dict)
    """What the step that made it wants recorded in the manifest (training stats, ...)."""
    base: Path | None = None
    """For an adapter: the model artifact it was trained on (its parent)."""
    quantization: str | None = None
    """For a model: the quantization method its weights carry, if any."""


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of the artifact at `path`; None when it has none; ValueError naming the fix
    when the file is there but no manifest (a directory, not UTF-8, not JSON, not an object)."""
    file = path / MANIFEST
    if not file.exists():
        return None
    try:
        manifest = json.loads(file.read_text())
        problem = None if isinstance(manifest, dict) else f"found {type(manifest).__name__}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problem = str(e).splitlines()[0] if str(e) else type(e).__name__
    if problem is not None:
        raise ValueError(
            f"{file}: not a workbench manifest (a JSON object): {problem}; rebuild the artifact, "
            f"or remove {MANIFEST} to load it without its integrity check"
        )
    return manifest


def artifact_from_manifest(path: Path) -> Artifact:
    """The artifact a complete directory holds, as its manifest describes it."""
    m = read_manifest(path) or {}
    base = m.get("parent", {}).get("path") if m.get("kind") == "adapter" else None
    return Artifact(
        path,
        m.get("kind", "model"),
        m.get("info", {}),
        Path(base) if base else None,
        m.get("quantization"),
    )


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _tmp_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temporary dir; on success it replaces `final`, on error it is removed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{_tmp_prefix(final)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def remove_stale_tmp(parent: Path, only: Path | None = None) -> list[Path]:
    """Delete leftovers of interrupted writers below `parent` (of `only`, a dir in it, when
    given); the caller must hold the lock that covers every writer whose leftovers it deletes:
    a temporary dir of a target another process is building now looks the same."""
    if not parent.is_dir():
        return []
    prefix = f".{only.name}." if only is not None else "."
    stale = [
        p
        for p in parent.iterdir()
        if p.name.startswith(prefix) and (".tmp-" in p.name or ".old-" in p.name)
    ]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(path: Path) -> dict[str, str]:
    """sha256 of every file of an artifact dir but its manifest, by relative path; recorded in
    the manifest as `files` and checked before the artifact is reused or served."""
    return {
        p.relative_to(path).as_posix(): file_sha256(p)
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def verify_files(path: Path, recorded: object) -> str | None:
    """None when every file a manifest records (its `files`: {relative path: sha256}) is there
    with its recorded content; else what differs (missing, changed, or no hashes recorded)."""
    if not isinstance(recorded, dict):
        return "its manifest records no file hashes (made by an older workbench)"
    inside = path.resolve()
    for name, expected in sorted(recorded.items()):
        file = path / name
        if not file.resolve().is_relative_to(inside):
            return f"its manifest names {name!r}, a file outside the artifact"
        if not file.is_file():
            return f"{name} is missing"
        if file_sha256(file) != expected:
            return f"{name} changed since it was built (sha256 mismatch)"
    return None


def check_intact(path: Path) -> None:
    """Raise ValueError when `path` is an artifact whose manifest records file hashes and a file
    no longer matches (a dir without a manifest, or with an older one, passes)."""
    manifest = read_manifest(path)
    if manifest is None or "files" not in manifest:
        return
    problem = verify_files(path, manifest["files"])
    if problem is not None:
        variant = manifest.get("variant") or path.name
        raise ValueError(
            f"{path}: {problem}; the artifact is corrupt: rebuild it "
            f"(workbench run RECIPE --variant {variant} rebuilds what changed)"
        )


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def count_parameters(path: Path) -> int:
    """Number of stored tensor elements in the dir's safetensors files (no weights loaded)."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(f.get_slice(name).get_shape())
    return total


def link_or_copy_tree(src: Path, dst: Path, skip: tuple[str, ...] = (MANIFEST,)) -> None:
    """Mirror `src` into the existing dir `dst`, hard-linking files where the filesystem allows."""
    for item in sorted(src.rglob("*")):
        rel = item.relative_to(src)
        if rel.parts[0] in skip or rel.parts[0].startswith("."):
            continue
        target = dst / rel
        if item.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(item, target)
        except OSError:
            shutil.copy2(item, target)


_MODEL_FILES = ("config.json", "generation_config.json", "adapter_config.json", MANIFEST)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
BUILD_RECORD_SUFFIX = ".build.json"
"""A file that records how a model dir itself was built (a demo model's training, a GGUF
conversion): it describes that dir only and is never copied into a variant derived from it."""


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy what is neither weights nor model config (tokenizer, chat template, ...) to `dst`."""
    for item in sorted(src.iterdir()):
        skipped = item.name in _MODEL_FILES or item.name.endswith(_WEIGHT_SUFFIXES)
        hidden = item.name.startswith(".") or item.name.endswith(BUILD_RECORD_SUFFIX)
        if item.is_file() and not skipped and not hidden:
            shutil.copy2(item, dst / item.name)

"""Where demo models live: built on first use into the user cache dir, then loaded like any HF dir.

The cache dir is `$WORKBENCH_CACHE_DIR` when set, else the platform's user cache dir. An entry is
named by the spec's hash, so a changed spec builds a new model instead of reusing a stale one.
Builds take a lock (concurrent callers wait and reuse) and are renamed into place when complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from catalog.train import BUILD_INFO, SPECS, DemoSpec, build
from compress.cache import CACHE_ENV, cache_dir
from compress.locking import build_once

__all__ = ["CACHE_ENV", "build_info", "cache_dir", "demo_model_dir", "ensure_demo_model"]
# NOTE: bump when the corpus, tokenizer or training code changes what a spec builds.
BUILD_VERSION = 2


def spec_hash(spec: DemoSpec) -> str:
    payload = json.dumps([BUILD_VERSION, dataclasses.asdict(spec)], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def demo_model_dir(name: str) -> Path:
    return cache_dir() / "models" / f"{name}-{spec_hash(SPECS[name])}"


def ensure_demo_model(name: str = "demo") -> Path:
    """The built model dir for a named spec, building it first when it is missing."""
    final = demo_model_dir(name)
    announce = f"building the offline demo model {name} into {final} (first use only)"
    return build_once(final, BUILD_INFO, lambda tmp: build(SPECS[name], tmp), announce)


def build_info(model_dir: Path) -> dict[str, object]:
    return json.loads((model_dir / BUILD_INFO).read_text())

"""Where built things are kept across runs: demo models, converted GGUF bases, data files, the
CPU attention kernel. `$WORKBENCH_CACHE_DIR` when set, else the platform's user cache dir."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir

CACHE_ENV = "WORKBENCH_CACHE_DIR"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or user_cache_dir("workbench"))

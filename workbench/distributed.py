"""Who writes what when a recipe runs in several processes (`accelerate launch`, `torchrun`).

Model: every process runs every step (training needs them all), but only the main process
takes the work-dir lock, writes artifacts and manifests, and evaluates; the others write their
step outputs to a scratch dir that is thrown away. After each artifact is renamed into place,
all processes meet at a barrier, so the next step reads the same, complete input everywhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _state() -> Any:
    from accelerate import PartialState

    return PartialState(cpu=not _cuda())


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def is_main() -> bool:
    return world_size() == 1 or _state().is_main_process


def barrier() -> None:
    if world_size() > 1:
        _state().wait_for_everyone()


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """Where a non-main process writes a step's output (deleted afterwards)."""
    path = Path(tempfile.mkdtemp(prefix="workbench-rank-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

"""An exclusive inter-process lock on a file (fcntl), held for a `with` block; and a directory
built once under it."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator
from pathlib import Path

from compress.artifact import atomic_dir, remove_stale_tmp


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_once(final: Path, marker: str, build: Callable[[Path], object], announce: str) -> Path:
    """`final`, built by `build(tmp dir)` when `final/marker` is missing: under a lock (concurrent
    callers wait, then reuse it), in a temporary dir renamed into place when complete (a killed
    build leaves only the temporary dir, which the next build removes). `announce` is printed
    before building."""
    if (final / marker).exists():
        return final
    with file_lock(final.parent / f"{final.name}.lock"):
        if (final / marker).exists():
            return final
        remove_stale_tmp(final.parent, only=final)  # the lock covers this target only
        from rich.console import Console

        Console(stderr=True, markup=False).print(announce)
        with atomic_dir(final) as tmp:
            build(tmp)
    return final

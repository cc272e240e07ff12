"""Measurements kept between runs: `<work dir>/evals/<variant>/<what>.json`, each under a key.

Model: the key hashes what the measurement depends on (the variant's artifact hash, the
measurement's settings, `EVALS_VERSION`). A file whose key matches and whose result still reads
as its type is reused, so rerunning an unchanged recipe measures nothing; any other file
(another key, another shape, damaged) is measured again. Files are written whole (temp file +
rename), so an interrupted run leaves the old result or none.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

if TYPE_CHECKING:  # only named in types: importing compress loads torch and every step
    from compress.record import Record

EVALS_VERSION = 4
"""Bump when what a measurement computes changes, so stale results are not reused."""

R = TypeVar("R", bound="Record")

QUALITY, DIVERGENCE, SERVER_CHECK, ANSWERS, LOAD = (
    "quality",
    "divergence",
    "server_check",
    "answers",
    "load",
)
"""What is kept for a variant: each its own file, named by `result_path`."""


def result_path(work_dir: Path, variant: str, what: str) -> Path:
    """Where `what` (QUALITY, DIVERGENCE, ...) of `variant` is kept in a run's work dir."""
    return work_dir / "evals" / variant / f"{what}.json"


def key(*parts: Any) -> str:
    text = json.dumps([EVALS_VERSION, *parts], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def lookup(path: Path, key: str, kind: type[R]) -> R | None:
    """The result stored at `path` under `key`, if any."""
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, ValidationError):
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return kind.from_json(stored["result"])
    return None


def store(path: Path, key: str, result: Record) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"key": key, "result": result.to_json()}, indent=2))
    tmp.replace(path)


def cached(
    path: Path, key: str, force: bool, kind: type[R], compute: Callable[[], R]
) -> tuple[R, bool]:
    """(result, reused): the stored result when its key matches, else `compute()` stored."""
    stored = None if force else lookup(path, key, kind)
    if stored is not None:
        return stored, True
    result = compute()
    store(path, key, result)
    return result, False

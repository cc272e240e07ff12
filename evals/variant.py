"""A variant as a run hands it on to the evals and the report: its artifact, its manifest and
how it is served."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from compress.manifest import Manifest
from evals.settings import ServeSettings


@dataclass(frozen=True)
class VariantResult:
    """Where the variant's artifact is, what its manifest says, and the recipe's `serve:` for it
    (two variants may share an artifact and differ only there)."""

    name: str
    path: Path
    status: Literal["built", "reused"]
    manifest: Manifest
    rebuilt_because: str | None = None
    """Why an artifact with the right hash was rebuilt instead of reused (its files changed)."""
    serve: ServeSettings = field(default_factory=ServeSettings)

"""What a built variant records about itself (`workbench.json`).

Model: the pipeline writes one `Manifest` per finished artifact; everything after the build (the
evals, the report, the CLI's table) reads the typed value, never the file's keys. Readers that
only need to load an artifact (the server) keep using `compress.artifact.artifact_from_manifest`,
which tolerates manifests of older workbenches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from compress.artifact import MANIFEST, ArtifactKind, write_manifest
from compress.record import Omitted, Record


class StepRecord(Record):
    name: str
    params: dict[str, Any]
    hash: str
    """The hash chain's value after this step: names the step's output artifact."""


class ArtifactEval(Record):
    """The finished model as loaded for evaluation (`evals.artifact_eval.evaluate`)."""

    load_seconds: float
    bytes_in_memory: int
    """Weights and buffers as loaded (an adapter variant: base + adapter)."""
    parameters_loaded: int
    trainable_parameters: int
    """LoRA parameters (0 for a model)."""
    eval_rows: int
    """0: perplexity not measured here (the recipe's divergence eval measures it, with standard
    errors, on its own windows)."""
    eval_seq_len: int
    perplexity_corpus: Omitted[float] = None
    perplexity_shift: Omitted[float] = None


class RecipeRef(Record):
    name: str
    hash: str


class BaseRecord(Record):
    kind: str
    name: str


class ParentRef(Record):
    path: str
    hash: str


class Manifest(Record):
    variant: str
    kind: ArtifactKind
    quantization: str | None
    hash: str
    recipe: RecipeRef
    base: BaseRecord
    steps: list[StepRecord]
    parent: ParentRef
    parameters: int
    """As the architecture defines them (a quantized weight counts as its float original); an
    adapter's stored tensor elements."""
    stored_tensor_elements: int
    bytes_on_disk: int
    wall_seconds: float
    peak_memory_bytes: int
    peak_cuda_memory_bytes: int | None
    packages: dict[str, str | None]
    created: str
    info: dict[str, Any]
    files: dict[str, str]
    """sha256 of every other file of the artifact, checked before reuse and serving."""
    eval: Omitted[ArtifactEval] = None

    def write(self, path: Path) -> None:
        write_manifest(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> Manifest | None:
        """The manifest of the artifact at `path`; None when there is none, or it is not one
        this workbench writes (an older or damaged one: the artifact is rebuilt)."""
        try:
            return cls.from_json(json.loads((path / MANIFEST).read_text()))
        except (FileNotFoundError, json.JSONDecodeError, ValidationError):
            return None

"""What one node of a run's graph does, wherever it runs: build or mirror an artifact, or measure
committed variants. `RunTasks` is what an executor calls; it pickles as the recipe's JSON and the
run's settings (`RunSpec`), and a Ray worker rebuilds the rest from them.

Measurement tasks store their result where `evals.stored` keeps it (under its key, reused by a
rerun) and hand back the small record too; `measure_variants` in the driver then reads them all
back, in recipe order, for the report.
"""

from __future__ import annotations

import functools
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evals.variant import VariantResult
from workbench.build_task import Builder, Evaluate
from workbench.recipe import Recipe
from workbench.remote_store import RemoteStore
from workbench.task_graph import ArtifactRef, Node


@dataclass(frozen=True)
class RunSpec:
    """A run's settings, as every task receives them."""

    recipe: str
    """The validated recipe as JSON."""
    recipe_dir: str
    """Where relative paths in the recipe (a local base) are resolved."""
    work_dir: str
    recipe_hash: str
    force: bool = False
    keep_checkpoints: int = 1
    evaluate: bool = False
    """Measure each built variant for its manifest (`evals.artifact_eval.evaluate`)."""
    store: RemoteStore | None = None
    """Storage at a URL, `work_dir` its local mirror: a task pulls what it reads and pushes
    what it commits (`workbench.remote_store`)."""


@functools.lru_cache(maxsize=4)
def _recipe(spec: RunSpec) -> tuple[Recipe, Any]:
    from catalog.data import NAMED
    from workbench.base_model import resolve_base

    context = {"recipe_dir": Path(spec.recipe_dir), "data": NAMED}
    recipe = Recipe.model_validate(json.loads(spec.recipe), context=context)
    return recipe, resolve_base(recipe.base, Path(spec.recipe_dir))


def _evaluate(recipe: Recipe) -> Evaluate:
    from evals.artifact_eval import evaluate

    rows = recipe.evals.divergence is None  # with a divergence eval, perplexity is measured there
    return lambda made: evaluate(made, perplexity_rows=rows)


@dataclass(frozen=True)
class Measured:
    """A measurement task's record: its result and what it reused and said."""

    result: Any
    reused: list[str] = field(default_factory=list)
    """`variant/quality`, ... for each result taken from an earlier run."""
    lines: list[str] = field(default_factory=list)


class RunTasks:
    """Runs one node; `evaluate` replaces the spec's (an in-process caller's own)."""

    def __init__(self, spec: RunSpec, evaluate: Evaluate | None = None) -> None:
        self.spec, self._evaluate = spec, evaluate

    def __reduce__(self) -> tuple[Any, ...]:
        return (RunTasks, (self.spec,))  # a worker derives `evaluate` from the spec

    @functools.cached_property
    def builder(self) -> Builder:
        recipe, base = _recipe(self.spec)
        evaluate = self._evaluate or (_evaluate(recipe) if self.spec.evaluate else None)
        work = Path(self.spec.work_dir)
        s = self.spec
        return Builder(recipe, base, work, s.recipe_hash, s.force, evaluate, s.keep_checkpoints)

    def __call__(self, node: Node, inputs: dict[str, Any]) -> Any:
        store = self.spec.store
        if store is None:
            return self._run(node, inputs)
        for ref in inputs.values():
            if isinstance(ref, ArtifactRef) and not store.pull(store.rel(ref.path)):
                raise FileNotFoundError(f"{store.url}/{store.rel(ref.path)}: not committed there")
        if node.out is not None:  # a build or mirror: its artifact
            if not self.spec.force:
                store.pull(node.out)  # committed by an earlier attempt: the builder reuses it
            result = self._run(node, inputs)
            store.push(node.out)
            return result
        store.pull_evals()  # a measurement: the stored results it may reuse, and its own
        before = store.evals_snapshot()
        result = self._run(node, inputs)
        store.push_evals(before)
        return result

    def _run(self, node: Node, inputs: dict[str, Any]) -> Any:
        if node.kind == "mirror":
            return self.builder.mirror(node, inputs[node.deps[0]])
        if node.kind in ("build", "calibrate", "train"):
            return self.builder.build(node, inputs[node.deps[0]] if node.deps else None)
        return self._measure(node, inputs)

    def _measure(self, node: Node, inputs: dict[str, ArtifactRef]) -> Measured:
        from evals import variant_evals
        from evals.variant_evals import Measurements

        recipe, _ = _recipe(self.spec)
        work, force = Path(self.spec.work_dir), self.spec.force
        results = [variant_result(recipe, name, inputs[key]) for name, key in node.reads]
        if node.kind == "quality":
            quality, reused = variant_evals.quality(recipe.evals, results[0], work, force)
            return Measured(quality, [f"{node.variant}/quality"] if reused else [])
        if node.kind == "divergence":
            mine = next(r for r in results if r.name == node.variant)
            div, reused = variant_evals.divergence_result(recipe.evals, mine, results, work, force)
            return Measured(div, [f"{node.variant}/divergence"] if reused else [])
        assert node.kind == "serving", f"{node.key}: not a task (the driver writes the report)"
        from evals.serving_evals import measure_serving

        out, lines = Measurements(), list[str]()
        measure_serving(recipe.evals, results, work, force, out, lines.append)
        record_gpu(recipe, results, work, out)
        return Measured(out, out.reused, lines)


def variant_result(recipe: Recipe, name: str, ref: ArtifactRef) -> VariantResult:
    """The variant as the evals take it, from its committed artifact's reference."""
    from compress.manifest import Manifest

    path = Path(ref.path)
    manifest = Manifest.read(path)
    assert manifest is not None and manifest.hash == ref.hash, f"{path}: committed as {ref.hash}"
    variant = next(v for v in recipe.variants if v.name == name)
    return VariantResult(name, path, ref.status, manifest, ref.problem, variant.serve)


def machine() -> str:
    """This machine, and its GPU when a task holds one: `host (NVIDIA H100 80GB HBM3)`."""
    gpu = None
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    return f"{socket.gethostname()} ({gpu})" if gpu else socket.gethostname()


def record_gpu(recipe: Recipe, results: list[VariantResult], work: Path, out: Any) -> None:
    """Each ramp this task measured (not reused, not a twin's copy) records the GPU it ran on."""
    from evals import stored
    from evals.serving_evals import load_key

    if recipe.evals.load is None:
        return
    gpu = machine().partition(" (")[2].rstrip(")") or None
    for r in results:
        found = out.load.get(r.name)
        if found is None or f"{r.name}/load" in out.reused or found.measured_on is not None:
            continue
        found = found.model_copy(update={"gpu": gpu})
        out.load[r.name] = found
        stored.store(
            stored.result_path(work, r.name, stored.LOAD), load_key(recipe.evals.load, r), found
        )

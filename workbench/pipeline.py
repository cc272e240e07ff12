"""Run a recipe: plan its task graph, and run the nodes not already committed with an executor.

Model: a step's output is named by a hash chain (`workbench.task_graph`), starting from the
base's fingerprint; each hash is built once per run, into `variants/<name>/` when it is that
variant's final artifact, else into `artifacts/<hash>/`, shared by variants with a common prefix.
An artifact whose manifest records the expected hash, and whose files still have the content
hashes the manifest records, is reused; any other (changed, truncated, missing files) is
rebuilt, and the result says why. Variants with the same steps (say, one served with an int8 KV
cache beside the plain one: they differ only in `serve:`) build once: the later one mirrors the
other's final artifact (hard links) under its own name. Every artifact is committed whole
(`workbench.build_task`), and one driver holds the work dir (`workbench.lease`), so an
interrupted run leaves only temporary dirs, which the next run deletes, and a rerun resumes by
skipping every committed hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from compress import STEPS, Artifact
from compress.artifact import count_parameters, remove_stale_tmp, verify_files
from compress.manifest import Manifest
from compress.registry import StepError
from evals.variant import VariantResult
from workbench.base_model import BaseRef, base_artifact, base_fingerprint
from workbench.build_task import Evaluate, manifest_digest, reusable
from workbench.distributed import barrier, is_main
from workbench.executor import Events, Executor, LocalExecutor, Tasks
from workbench.lease import driver_lease
from workbench.model_shape import module_names, position_limit
from workbench.recipe import Recipe, Variant
from workbench.remote_store import RemoteStore
from workbench.run_tasks import RunSpec, RunTasks
from workbench.task_graph import ArtifactRef, GraphSettings, Node, TaskGraph, plan, plan_work, sha

__all__ = ["Evaluate", "Pipeline", "PipelineError", "VariantResult", "recipe_hash"]

EXECUTION_FIELDS: dict[str, Any] = {
    "resources": True,
    "storage": True,
    "variants": {"__all__": {"resources"}},
}
"""Where and on what a recipe runs: no part of what it makes, so no part of its hash."""


def recipe_hash(recipe: Recipe) -> str:
    dumped = recipe.model_dump(mode="json", exclude=EXECUTION_FIELDS)
    return sha(json.dumps(dumped, sort_keys=True))


class PipelineError(Exception):
    """Steps that cannot run as written; raised before anything is built."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class Pipeline:
    """One recipe run in one work dir; `run()` returns what it built and what it reused."""

    def __init__(
        self,
        recipe: Recipe,
        base: BaseRef,
        work_dir: Path,
        force: bool = False,
        evaluate: Evaluate | None = None,
        keep_checkpoints: int = 1,
        recipe_dir: Path | None = None,
        store: RemoteStore | None = None,
    ) -> None:
        """With a `store`, `work_dir` is its local mirror (`workbench.remote_store`)."""
        self.recipe, self.base, self.work_dir, self.force = recipe, base, work_dir, force
        self.store = store
        self.keep_checkpoints = keep_checkpoints
        self.recipe_hash = recipe_hash(recipe)
        self.evaluate = evaluate
        self.recipe_dir = recipe_dir or Path.cwd()
        self._locked = False
        self._problems: dict[str, str] = {}
        """Why a node's artifact with the right hash was not reused (its files changed)."""

    def check(
        self,
        variants: list[Variant],
        module_names: list[str] | None,
        position_limit: int | None = None,
    ) -> None:
        """Each step must accept what the step before it makes, and its params must fit the
        model (e.g. targets that exist; not checked when `module_names` is None); no training
        window or eval length may pass the base's `position_limit`; every problem is reported
        at once."""
        problems = self.recipe.evals.length_problems(position_limit)
        for v_index, variant in enumerate(self.recipe.variants):
            if variant not in variants:
                continue
            state = Artifact(Path(), "model")
            for s_index, (name, params) in enumerate(variant.step_calls()):
                where = f"variants[{v_index}] ({variant.name}).steps[{s_index}].{name}"
                step = STEPS[name](params)
                if state.kind not in step.accepts:
                    problems.append(
                        f"{where}: cannot follow a step that makes a {state.kind} "
                        f"(it takes a {' or '.join(step.accepts)}); reorder the steps"
                    )
                    break
                seq_len = getattr(params, "seq_len", None)
                if position_limit is not None and seq_len is not None and seq_len > position_limit:
                    problems.append(
                        f"{where}.seq_len: {seq_len} is past the base's position limit "
                        f"({position_limit} positions); use {position_limit} or less"
                    )
                try:
                    step.check(state, module_names)
                except StepError as e:
                    problems.append(f"{where}: {e}")
                state = step.planned_output(state)
        if problems:
            raise PipelineError(problems)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the work dir as its one driver (on the main process: `workbench.lease`),
        leftovers of killed builds removed: `run` takes it, and a caller that also measures what
        was built holds it across both, so no other run can swap a variant under a measurement.
        Re-entrant per pipeline."""
        if self._locked:
            yield
            return
        url = self.store.url if self.store else None
        lease = driver_lease(self.work_dir, url) if is_main() else contextlib.nullcontext()
        with lease:
            self._locked = True
            try:
                if is_main():
                    for sub in ("variants", "artifacts"):
                        remove_stale_tmp(self.work_dir / sub)
                barrier()
                yield
            finally:
                self._locked = False

    def run(
        self,
        only: list[str] | None = None,
        on_result: Callable[[VariantResult], None] | None = None,
    ) -> list[VariantResult]:
        """Build (or reuse) the variants named in `only` (default all), in this process."""
        variants = self.variants(only)
        with self.locked():
            graph = self.graph(variants, measure=False)
            results = self.execute(graph, LocalExecutor(), self.tasks(), lambda _: None)
        found = self.variant_results(graph, results)
        for r in found if on_result and is_main() else []:
            on_result(r)  # type: ignore[misc]  # on_result is set: checked on the line above
        return found

    def variants(self, only: list[str] | None) -> list[Variant]:
        """The variants to run, checked (`check`) before anything is built."""
        variants = [v for v in self.recipe.variants if only is None or v.name in only]
        base = base_artifact(self.base)
        self.check(variants, module_names(base.path), position_limit(base.path))
        return variants

    def graph(self, variants: list[Variant], measure: bool, gpus: bool = False) -> TaskGraph:
        base = base_artifact(self.base)
        settings = GraphSettings(4 * count_parameters(base.path), gpus, measure)
        return plan(self.recipe, variants, base_fingerprint(self.base), settings)

    def tasks(self) -> RunTasks:
        """What runs each node: this pipeline's settings (its own `evaluate` in this process)."""
        spec = RunSpec(
            recipe=self.recipe.model_dump_json(),
            recipe_dir=str(self.recipe_dir),
            work_dir=str(self.work_dir.absolute()),
            recipe_hash=self.recipe_hash,
            force=self.force,
            keep_checkpoints=self.keep_checkpoints,
            evaluate=self.evaluate is not None,
            store=self.store,
        )
        return RunTasks(spec, self.evaluate)

    def execute(
        self, graph: TaskGraph, executor: Executor, tasks: Tasks, events: Events
    ) -> dict[str, Any]:
        """Every node's result by key: the committed artifacts found, then what `executor` ran
        (the report node excepted: the caller writes it from these). Under the lock."""
        assert self._locked, "execute holds the work dir: call it inside `locked()`"
        barrier()  # every process decides on the same files
        self._problems = {}
        todo, done = plan_work(graph, self._committed)
        todo = [n for n in todo if n.kind != "report"]
        return executor.run(todo, done, tasks, events)

    def _committed(self, node: Node) -> ArtifactRef | None:
        """The node's artifact when it is committed and intact (never with `force`)."""
        assert node.out is not None
        expected = node.deps[0] if node.kind == "mirror" else node.key
        path, problems = self.work_dir / node.out, list[str]()
        if self.store is not None:  # committed at the URL: a task that reads it pulls it
            committed = None if self.force else self.store.committed(node.out)
            if committed is None or committed[1].get("hash") != expected:
                return None
            digest = hashlib.sha256(committed[0]).hexdigest()
            return ArtifactRef(expected, str(path), digest, "reused")
        if self.force or _reusable(path, expected, problems) is None:
            if problems:
                self._problems[node.key] = problems[0]
            return None
        return ArtifactRef(expected, str(path), manifest_digest(path), "reused")

    def variant_results(self, graph: TaskGraph, results: dict[str, Any]) -> list[VariantResult]:
        """The run's variants, in recipe order, as the evals and the report take them."""
        out = []
        for name, key in graph.finals.items():
            ref: ArtifactRef = results[key]
            if self.store is not None:  # the report reads each variant's files (`serves_in`)
                self.store.pull(self.store.rel(ref.path))
            manifest = Manifest.read(Path(ref.path))
            assert manifest is not None and manifest.hash == ref.hash, f"{ref.path}: committed"
            variant = next(v for v in self.recipe.variants if v.name == name)
            because = "; ".join(self._chain_problems(graph, key)) or None
            fresh = ref.status == "built" and self._fresh(graph.nodes[key])
            status: Literal["built", "reused"] = "built" if fresh else "reused"
            path = self.work_dir / str(graph.nodes[key].out)  # as the caller named the work dir
            out.append(VariantResult(name, path, status, manifest, because, variant.serve))
        return out

    def _fresh(self, node: Node) -> bool:
        """A built node's artifact counts as built for its variant unless it mirrors another's
        (with `force` nothing is reused: a mirror of this run's build is built too)."""
        return node.kind != "mirror" or self.force

    def _chain_problems(self, graph: TaskGraph, key: str) -> list[str]:
        """Why the artifacts on the way to `key` were rebuilt, first step first."""
        problems, node = [], graph.nodes[key]
        while True:
            if node.key in self._problems:
                problems.append(self._problems[node.key])
            if not node.deps:
                return problems[::-1]
            node = graph.nodes[node.deps[0]]


def _reusable(path: Path, expected: str, problems: list[str]) -> Manifest | None:
    """`build_task.reusable`, files checked through this module's `verify_files`."""
    return reusable(path, expected, problems, verify_files)

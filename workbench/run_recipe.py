"""A recipe from YAML to report, in one call: build the variants, measure them, write the report.

The sequence of typed hand-offs: `load_recipe` -> (`Recipe`, `BaseRef`) -> `Pipeline.graph` (the
task graph: builds, measurements, the report) -> an executor runs what is not committed yet ->
`list[VariantResult]` (each with its `Manifest`) and the measurements the tasks stored ->
`evals.measure.measure_variants` reads them back -> `Measurements` ->
`reports.report.build_report` -> the report (JSON, Markdown, HTML) on disk -> `RunResult`. The
CLI parses flags, calls `run` and prints; tests call `run` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals.variant import VariantResult
from evals.variant_evals import Measurements
from workbench.base_model import BaseRef
from workbench.build_task import Evaluate
from workbench.distributed import is_main
from workbench.executor import Executor, LocalExecutor, describe
from workbench.pipeline import Pipeline
from workbench.recipe import Recipe, RecipeError, load_recipe
from workbench.remote_store import RemoteStore
from workbench.run_tasks import Measured
from workbench.storage import check_writable, is_url
from workbench.task_graph import TaskGraph


@dataclass(frozen=True)
class RunResult:
    recipe: Recipe
    base: BaseRef
    work_dir: Path
    variants: list[VariantResult]
    """In recipe order: built or reused, each with its manifest."""
    measurements: Measurements | None
    """None on the non-main processes of a distributed run (the main process measures)."""
    report: dict[str, Any] | None
    """What `report.json` holds; None where `measurements` is."""
    report_dir: Path

    @property
    def built(self) -> list[str]:
        return [v.name for v in self.variants if v.status == "built"]

    @property
    def reused(self) -> list[str]:
        return [v.name for v in self.variants if v.status == "reused"]


def run(
    recipe_path: Path | str,
    work_dir: Path | str | None = None,
    *,
    variants: list[str] | None = None,
    force: bool = False,
    keep_checkpoints: int = 1,
    report_dir: Path | str | None = None,
    on_variant: Callable[[VariantResult], None] | None = None,
    progress: Callable[[str], None] = lambda _: None,
    executor: Executor | None = None,
) -> RunResult:
    """Build (or reuse) the recipe's variants in `work_dir` (default: the recipe's `storage:`,
    else `runs/<recipe name>`; an fsspec URL: `workbench.remote_store`), measure them and write
    the report to `report_dir` (default: the recipe's `report.output_dir`, else
    `reports/<recipe name>`). `variants` limits the run to
    those names; `force` rebuilds and measures again; `executor` runs the tasks (default: this
    process, one after another). Raises `RecipeError` / `PipelineError` (and the executor's
    own errors, e.g. an unreachable cluster) before anything is built."""
    recipe, base = load_recipe(recipe_path)
    _check_variant_names(Path(recipe_path), recipe, variants)
    where = work_dir or recipe.storage or Path("runs") / recipe.name
    store = RemoteStore.at(str(where)) if is_url(where) else None  # checked before any work
    work = Path(store.local) if store else Path(where)
    out_dir = Path(report_dir or recipe.report.output_dir or Path("reports") / recipe.name)
    progress(f"recipe {recipe.name}: base {base.name} ({base.kind}), work dir {work}")
    pipeline = Pipeline(
        recipe,
        base,
        work,
        force=force,
        evaluate=_evaluate(recipe),
        keep_checkpoints=keep_checkpoints,
        recipe_dir=Path(recipe_path).parent.absolute(),
        store=store,
    )
    executor = executor or LocalExecutor()
    check_writable(work)
    chosen = pipeline.variants(variants)
    prepare = getattr(executor, "prepare", None)
    gpus = prepare(recipe, work, store) if prepare is not None else False  # checks first
    if recipe.evals.run_the_engine and is_main():  # compiled beside the builds, not before evals
        from serve.model.kernel_builds import prebuild_engine_kernels

        prebuild_engine_kernels()
    with pipeline.locked():  # measured under the lease the build took
        graph = pipeline.graph(chosen, measure=is_main(), gpus=gpus and recipe.device != "cpu")
        done = pipeline.execute(graph, executor, pipeline.tasks(), lambda e: progress(describe(e)))
        results = pipeline.variant_results(graph, done)
        for r in results if on_variant and is_main() else []:
            on_variant(r)  # type: ignore[misc]  # on_variant is set: checked on the line above
        if not is_main():  # under accelerate launch / torchrun the main process measures
            return RunResult(recipe, base, work, results, None, None, out_dir)
        if store is not None:
            store.pull_evals()
        measured = _gathered(recipe, graph, done, results, work, progress)
    from reports.report import build_report, write_report

    report = build_report(
        recipe.name, recipe.report.title, recipe.evals, results, measured, recipe.gates
    )
    write_report(report, out_dir)
    return RunResult(recipe, base, work, results, measured, report, out_dir)


def _evaluate(recipe: Recipe) -> Evaluate:
    from evals.artifact_eval import evaluate

    # with a divergence eval the recipe measures perplexity itself (same rows, standard errors)
    rows = recipe.evals.divergence is None
    return lambda made: evaluate(made, perplexity_rows=rows)


def _gathered(
    recipe: Recipe,
    graph: TaskGraph,
    done: dict[str, Any],
    results: list[VariantResult],
    work: Path,
    progress: Callable[[str], None],
) -> Measurements:
    """Every measurement the tasks stored, read back in recipe order (`measure_variants` finds
    each under its key), and what of it an earlier run had measured."""
    from evals import measure

    records: list[Measured] = [done[k] for k, n in graph.nodes.items() if n.kind in MEASURED]
    for record in records:
        for line in record.lines:
            progress(line)
    div = recipe.evals.divergence
    if div is not None and div.reference not in graph.finals:
        ref = div.reference
        progress(f"divergence: skipped, {ref!r} is not in this run (--variant {ref})")
    measured = measure.measure_variants(recipe.evals, results, work, False)
    earlier = {item for record in records for item in record.reused}
    measured.reused = [item for item in measured.reused if item in earlier]
    return measured


MEASURED = frozenset({"quality", "divergence", "serving"})


def _check_variant_names(path: Path, recipe: Recipe, names: list[str] | None) -> None:
    unknown = sorted(set(names or []) - {v.name for v in recipe.variants})
    if unknown:
        allowed = ", ".join(v.name for v in recipe.variants)
        raise RecipeError(
            path, [f"--variant {', '.join(unknown)}: not in the recipe; allowed: {allowed}"]
        )

"""A recipe from YAML to report, in one call: build the variants, measure them, write the report.

The sequence of typed hand-offs: `load_recipe` -> (`Recipe`, `BaseRef`) -> `Pipeline.run` ->
`list[VariantResult]` (each with its `Manifest`) -> `evals.variant_evals.measure_variants` ->
`Measurements` -> `reports.report.build_report` -> the report (JSON, Markdown, HTML) on disk ->
`RunResult`. The CLI parses flags, calls `run` and prints; tests call `run` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals.variant import VariantResult
from evals.variant_evals import Measurements
from workbench.base_model import BaseRef
from workbench.distributed import is_main
from workbench.pipeline import Pipeline
from workbench.recipe import Recipe, RecipeError, load_recipe


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
) -> RunResult:
    """Build (or reuse) the recipe's variants in `work_dir` (default `runs/<recipe name>`),
    measure them and write the report to `report_dir` (default: the recipe's `report.output_dir`,
    else `reports/<recipe name>`). `variants` limits the run to those names; `force` rebuilds and
    measures again. Raises `RecipeError` / `PipelineError` before anything is built."""
    from evals.artifact_eval import evaluate
    from evals.variant_evals import measure_variants
    from reports.report import build_report, write_report

    recipe, base = load_recipe(recipe_path)
    _check_variant_names(Path(recipe_path), recipe, variants)
    work = Path(work_dir or Path("runs") / recipe.name)
    out_dir = Path(report_dir or recipe.report.output_dir or Path("reports") / recipe.name)
    progress(f"recipe {recipe.name}: base {base.name} ({base.kind}), work dir {work}")
    if recipe.evals.run_the_engine and is_main():  # compiled beside the builds, not before evals
        from serve.model.kernel_builds import prebuild_engine_kernels

        prebuild_engine_kernels()
    # with a divergence eval the recipe measures perplexity itself (same rows, standard errors)
    rows = recipe.evals.divergence is None
    pipeline = Pipeline(
        recipe,
        base,
        work,
        force=force,
        evaluate=lambda made: evaluate(made, perplexity_rows=rows),
        keep_checkpoints=keep_checkpoints,
    )
    with pipeline.locked():  # measured under the lock the build took
        results = pipeline.run(variants, on_result=on_variant)
        if not is_main():  # under accelerate launch / torchrun the main process measures
            return RunResult(recipe, base, work, results, None, None, out_dir)
        measured = measure_variants(recipe.evals, results, work, force, progress)
    report = build_report(recipe.name, recipe.report.title, recipe.evals, results, measured)
    write_report(report, out_dir)
    return RunResult(recipe, base, work, results, measured, report, out_dir)


def _check_variant_names(path: Path, recipe: Recipe, names: list[str] | None) -> None:
    unknown = sorted(set(names or []) - {v.name for v in recipe.variants})
    if unknown:
        allowed = ", ".join(v.name for v in recipe.variants)
        raise RecipeError(
            path, [f"--variant {', '.join(unknown)}: not in the recipe; allowed: {allowed}"]
        )

"""Every measurement of a run's variants, in recipe order: quality and divergence
(`evals.variant_evals`), then serving (`evals.serving_evals`); each stored and reused as
`evals.stored` describes, handed to the report as one typed `Measurements`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from evals.serving_evals import measure_serving
from evals.settings import Evals
from evals.variant import VariantResult
from evals.variant_evals import Measurements, divergence_result, quality


def measure_variants(
    evals: Evals,
    results: list[VariantResult],
    work_dir: Path,
    force: bool = False,
    progress: Callable[[str], None] = lambda _: None,
) -> Measurements:
    out = Measurements()
    for r in results:
        if evals.quality:
            out.quality[r.name], reused = quality(evals, r, work_dir, force)
            progress(f"quality {r.name}: {'reused' if reused else 'measured'}")
            if reused:
                out.reused.append(f"{r.name}/quality")
        div, reused = divergence_result(evals, r, results, work_dir, force)
        if div is None and evals.divergence is not None:
            ref = evals.divergence.reference
            progress(f"divergence {r.name}: skipped, {ref!r} is not in this run (--variant {ref})")
        if div is not None:
            out.divergence[r.name] = div
            progress(f"divergence {r.name}: {'reused' if reused else 'measured'}")
            if reused:
                out.reused.append(f"{r.name}/divergence")
    if evals.load is not None or evals.chat_prompts:
        measure_serving(evals, results, work_dir, force, out, progress)
    return out

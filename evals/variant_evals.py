"""The in-process measurements of a built variant: quality with lm-eval and divergence from the
reference variant (serving under load: `evals.serving_evals`; all of them for a run:
`evals.measure.measure_variants`).

Each measurement is stored and reused as `evals.stored` describes; `Measurements` is what the
report receives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress.artifact import artifact_from_manifest
from evals import stored
from evals.divergence import ReferenceMemo
from evals.results import (
    ChatAnswer,
    DivergenceResult,
    ItemScores,
    LoadResult,
    QualityResult,
    ServerCheck,
    TaskScore,
    VariantEvals,
)
from evals.settings import Evals
from evals.variant import VariantResult

MAX_DEFAULT_LENGTH = 2048
REFERENCE_SCORES = ReferenceMemo(budget_bytes=1 << 30)
"""The divergence reference's log-probabilities, computed once per process for all variants
(the demo's two data sets: 0.8 GB, 8 s of the base's forward passes saved per variant)."""


def eval_max_length(evals: Evals, variant: VariantResult) -> int:
    if evals.max_length:
        return evals.max_length
    from transformers import AutoConfig

    artifact = artifact_from_manifest(variant.path)
    source = artifact.base if artifact.kind == "adapter" and artifact.base else variant.path
    config = AutoConfig.from_pretrained(source)
    return min(
        int(getattr(config, "max_position_embeddings", 0) or 0) or MAX_DEFAULT_LENGTH,
        MAX_DEFAULT_LENGTH,
    )


def load_model(variant: VariantResult, dtype: str = "float32") -> tuple[Any, Any]:
    """The variant as lm-eval scores it (an adapter on its base), attending as its server's KV
    cache stores keys and values (`evals.int8_kv`), and its tokenizer."""
    import torch
    from transformers import AutoTokenizer

    from evals.artifact_eval import load_for_eval
    from evals.int8_kv import with_kv_cache_dtype

    artifact = artifact_from_manifest(variant.path)
    model = load_for_eval(artifact, getattr(torch, dtype))
    model = with_kv_cache_dtype(model, variant.serve.kv_cache_dtype)
    return model, AutoTokenizer.from_pretrained(variant.path)


def engine_lm(variant: VariantResult, evals: Evals, max_length: int) -> Any:
    """The variant in the engine as lm-eval's model (an adapter: on its base, through LoRA)."""
    from evals.engine_lm import EngineLM

    artifact = artifact_from_manifest(variant.path)
    adapter = artifact.kind == "adapter"
    return EngineLM(
        artifact.base if adapter and artifact.base else variant.path,
        dtype=evals.quality_dtype(),
        max_length=max_length,
        lora=variant.path if adapter else None,
        kv_cache_dtype=variant.serve.kv_cache_dtype,
    )


def measure_quality(evals: Evals, variant: VariantResult) -> QualityResult:
    from lm_eval import __version__ as lm_eval_version

    from evals.quality import evaluate_model, item_scores, run_tasks, summarize

    started = time.perf_counter()
    max_length = eval_max_length(evals, variant)
    if evals.backend == "engine":
        results = run_tasks(
            engine_lm(variant, evals, max_length), None, evals.task_requests(), None, True
        )
    else:
        model, tokenizer = load_model(variant, evals.quality_dtype())
        results = evaluate_model(
            model, tokenizer, evals.task_requests(), max_length, batch_size=evals.batch_size
        )
    tasks = summarize(results, evals.task_names(), results["workbench_sources"])
    items = {name: item_scores(results, name) for name in tasks}
    return QualityResult(
        tasks={name: TaskScore.from_json(scores) for name, scores in tasks.items()},
        items={name: ItemScores.from_json(i) for name, i in items.items() if i is not None},
        max_length=max_length,
        dtype=evals.quality_dtype(),
        lm_eval_version=lm_eval_version,
        seconds=round(time.perf_counter() - started, 2),
    )


def quality(
    evals: Evals, variant: VariantResult, work_dir: Path, force: bool
) -> tuple[QualityResult, bool]:
    key = stored.key(
        variant.manifest.hash, evals.quality_key(), evals.max_length, "items", *variant.serve.key()
    )
    path = stored.result_path(work_dir, variant.name, stored.QUALITY)
    return stored.cached(path, key, force, QualityResult, lambda: measure_quality(evals, variant))


def measure_divergence(
    evals: Evals, variant: VariantResult, reference: VariantResult
) -> DivergenceResult:
    """KL / agreement / perplexity of `variant` against `reference`, per data set."""
    import hashlib

    from catalog.data import NAMED
    from compress.data import load_texts, token_rows
    from evals.divergence import divergence, scored_bytes, window_log_probs

    settings = evals.divergence
    assert settings is not None
    started = time.perf_counter()
    model, tokenizer = load_model(variant, settings.dtype)
    ref_model = model if variant.name == reference.name else None
    data = {}
    for name in settings.data:
        rows = token_rows(tokenizer, load_texts(name, "validation", NAMED), settings.seq_len)
        rows = rows[: settings.windows]
        key = (
            reference.manifest.hash,
            repr(reference.serve.key()),
            settings.dtype,
            hashlib.sha256(rows.numpy().tobytes()).hexdigest(),
        )
        scores = REFERENCE_SCORES.get(key)
        if scores is None:
            if ref_model is None:
                ref_model = load_model(reference, settings.dtype)[0]
            scores = window_log_probs(ref_model, rows)
            REFERENCE_SCORES.put(key, scores)
        ours = scores if ref_model is model else model
        data[name] = divergence(scores, ours, rows, scored_bytes(tokenizer, rows))
    return DivergenceResult.from_json(
        {
            "reference": reference.name,
            "dtype": settings.dtype,
            "data": data,
            "seconds": round(time.perf_counter() - started, 2),
        }
    )


def divergence_result(
    evals: Evals,
    variant: VariantResult,
    results: list[VariantResult],
    work_dir: Path,
    force: bool,
) -> tuple[DivergenceResult | None, bool]:
    """(stats against the recipe's reference variant, reused); the reference against itself
    gives its own perplexity and bits per byte. (None, False) when there is no divergence eval,
    or `--variant` left the reference out of this run."""
    settings = evals.divergence
    reference = next((r for r in results if settings and r.name == settings.reference), None)
    if settings is None or reference is None:
        return None, False
    served = [variant.serve.key(), reference.serve.key()]  # [[], []]: both at the defaults
    key = stored.key(
        variant.manifest.hash,
        reference.manifest.hash,
        settings.model_dump(mode="json"),
        "windows",
        *([served] if any(served) else []),
    )
    path = stored.result_path(work_dir, variant.name, stored.DIVERGENCE)
    return stored.cached(
        path, key, force, DivergenceResult, lambda: measure_divergence(evals, variant, reference)
    )


@dataclass
class Measurements:
    """What `measure_variants` hands the report, by variant name."""

    quality: dict[str, QualityResult] = field(default_factory=dict)
    divergence: dict[str, DivergenceResult] = field(default_factory=dict)
    load: dict[str, LoadResult] = field(default_factory=dict)
    answers: dict[str, list[ChatAnswer]] = field(default_factory=dict)
    """Greedy chat answers, in the recipe's prompt order."""
    server_check: ServerCheck | None = None
    reused: list[str] = field(default_factory=list)
    """`variant/quality`, `variant/load`, ... for every result taken from an earlier run."""

    def of(self, name: str) -> VariantEvals:
        return VariantEvals(
            quality=self.quality.get(name),
            divergence=self.divergence.get(name),
            load=self.load.get(name),
            answers=self.answers.get(name),
        )

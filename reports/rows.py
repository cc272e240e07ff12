"""One row per variant: the figures the report's table, plots and dashboard show.

Model: a row is a flat dict of numbers and names built from a variant's manifest, its lm-eval
results and its load benchmark; `reports.metrics` says how each is labelled and which direction
is better. Quality per task is its headline metric (`reports.metrics.headline`). Recovery against the base (100% = the base's quality) is
variant/base accuracy, and for perplexity base/variant bits per byte (the log of perplexity,
so a variant twice as perplexed per byte is at 50%, not at a ratio of exponentials).
"""

from __future__ import annotations

from typing import Any

from compress.manifest import Manifest
from evals.results import LoadResult, VariantEvals
from evals.settings import ServeSettings
from reports.metrics import (
    BYTES_ON_DISK,
    CAPACITY_CONC,
    CAPACITY_RATE,
    DIVERGENCE_STATS,
    FAILED_REQUESTS,
    KIND,
    KV_BYTES_PER_TOKEN,
    KV_TOKENS,
    P95_E2E,
    P95_ITL,
    PARAMETERS,
    PEAK_REQ_S,
    PEAK_TOK_S,
    RAN_ON,
    RECOVERY,
    REFERENCE_CONCURRENCY,
    SATURATION,
    SATURATION_ESTIMATE,
    STEPS,
    TRAINABLE,
    VARIANT,
    WEIGHT_BYTES,
    bits_per_byte_key,
    headline,
    lower_is_better,
    stderr_key,
    task_measure,
)


def describe_steps(manifest: Manifest) -> str:
    parts = []
    for step in manifest.steps:
        params = step.params
        detail = params.get("method") or (f"r={params['rank']}" if "rank" in params else "")
        if step.name == "distill":
            detail = f"{params.get('layers')} layers, {'KD' if params.get('kd') else 'CE'}"
        parts.append(f"{step.name}({detail})" if detail else step.name)
    return " + ".join(parts) or "identity"


def load_columns(load: LoadResult | None) -> dict[str, Any]:
    """Peak throughput, p95 at the reference concurrency and saturation, per prompt length."""
    if not load:
        return {}
    capacity = load.capacity or {}
    row: dict[str, Any] = {
        KV_BYTES_PER_TOKEN.key: load.server.kv_bytes_per_token,
        KV_TOKENS: load.kv_tokens,
        PEAK_TOK_S.key: max(p.output_throughput for p in load.points),
        PEAK_REQ_S.key: max(p.request_throughput for p in load.points),
        FAILED_REQUESTS.key: sum(p.failed for p in load.every_point()),
        RAN_ON.key: ran_on(load),
    }
    for length, cap in capacity.items():
        row[CAPACITY_CONC.key(length)] = cap.concurrency
        row[CAPACITY_RATE.key(length)] = cap.request_rate
    for length, sat in load.saturation.items():
        point = load.at(int(length), REFERENCE_CONCURRENCY)
        row[P95_E2E.key(length)] = point.e2e.p95 if point else None
        itl = point.itl if point else None
        row[P95_ITL.key(length)] = itl.p95 if itl else None
        row[SATURATION.key(length)] = sat.measured_concurrency
        estimate = sat.estimated_concurrency
        row[SATURATION_ESTIMATE.key(length)] = round(estimate, 1) if estimate is not None else None
    return row


def ran_on(load: LoadResult) -> str | None:
    """The machine the ramp ran on, and its GPU or else its CPU: `node-3 (NVIDIA H100 80GB
    HBM3)`, `vm (AMD EPYC, 2 CPUs)`; a twin's ramp names the variant it was measured as."""
    m = load.measured
    where = (f"{m.host} ({load.gpu or f'{m.cpu}, {m.cpu_count} CPUs'})") if m else None
    if load.measured_on:
        return f"as {load.measured_on}" + (f" on {where}" if where else "")
    return where


def variant_row(
    name: str, manifest: Manifest, evals: VariantEvals, serve: ServeSettings | None = None
) -> dict[str, Any]:
    """`steps` names the variant's steps and how it is served when that is not the default."""
    ev = manifest.eval
    served = serve.describe() if serve else ""
    row: dict[str, Any] = {
        VARIANT.key: name,
        KIND: manifest.kind,
        STEPS.key: " + ".join(filter(None, [describe_steps(manifest), served])),
        PARAMETERS.key: manifest.parameters,
        TRAINABLE: (ev.trainable_parameters or None) if ev else None,
        WEIGHT_BYTES.key: ev.bytes_in_memory if ev else None,
        BYTES_ON_DISK: manifest.bytes_on_disk,
    }
    for task, score in (evals.quality.tasks if evals.quality else {}).items():
        measure = headline(task, score)
        if measure:
            row[task] = score.metric(measure)
            row[stderr_key(task)] = score.metric(f"{measure}_stderr")
        if score.bits_per_byte is not None:
            row[bits_per_byte_key(task)] = score.bits_per_byte
    for data, stats in (evals.divergence.data if evals.divergence else {}).items():
        for family, (stat, stderr) in DIVERGENCE_STATS.items():
            row[family.key(data)] = getattr(stats, stat)
            if stderr:
                row[stderr_key(family.key(data))] = getattr(stats, stderr)
    row.update(load_columns(evals.load))
    return row


def add_recovery(
    rows: list[dict[str, Any]],
    tasks: list[str],
    measured: dict[str, VariantEvals],
    reference: str | None,
) -> None:
    """Each task's recovery in percent against the reference's row; a row without the task
    gets None."""
    if not rows:
        return
    base = next((r for r in rows if r[VARIANT.key] == reference), rows[0])
    for task in tasks:
        metric = task_measure(measured, task)
        for r in rows:
            value, ref = r.get(task), base.get(task)
            key = RECOVERY.key(task)
            if value is None or not ref or metric is None:
                r[key] = None
            elif lower_is_better(metric):
                bpb, ref_bpb = r.get(bits_per_byte_key(task)), base.get(bits_per_byte_key(task))
                r[key] = 100.0 * ref_bpb / bpb if bpb and ref_bpb else None
            else:
                r[key] = 100.0 * value / ref


def front(rows: list[dict[str, Any]], axes: list[tuple[str, bool]]) -> list[str]:
    """Variants no other variant beats on every axis (`(key, lower_is_better)`): at least as
    good on all and strictly better on one. Rows missing an axis are left out; ties are kept."""

    def at_least(a: dict, b: dict, key: str, lower: bool) -> bool:
        return a[key] <= b[key] if lower else a[key] >= b[key]

    usable = [r for r in rows if all(r.get(k) is not None for k, _ in axes)]
    return [
        r[VARIANT.key]
        for r in usable
        if not any(
            all(at_least(o, r, k, lower) for k, lower in axes)
            and any(o[k] != r[k] for k, _ in axes)
            for o in usable
            if o is not r
        )
    ]


def pareto_front(rows: list[dict[str, Any]], quality_key: str, lower_better: bool) -> list[str]:
    """Variants no other variant beats on both weight memory and quality (ties kept)."""
    return front(
        [r for r in rows if r.get(WEIGHT_BYTES.key)],
        [(WEIGHT_BYTES.key, True), (quality_key, lower_better)],
    )

"""One row per variant: the figures the report's table, plots and dashboard show.

Model: a row is a flat dict of numbers and names built from a variant's manifest, its lm-eval
results and its load benchmark; `columns` says how each is labelled and which direction is
better. Quality per task is one headline metric (word perplexity for rolling-perplexity tasks,
accuracy for multiple choice). Recovery against the base (100% = the base's quality) is
variant/base accuracy, and for perplexity base/variant bits per byte (the log of perplexity,
so a variant twice as perplexed per byte is at 50%, not at a ratio of exponentials).
"""

from __future__ import annotations

from typing import Any

from compress.manifest import Manifest
from evals.results import LoadResult, TaskScore, VariantEvals

HEADLINE = ("word_perplexity", "acc")
DIVERGENCE = (  # row key prefix, `evals.divergence` statistic and its stderr, label, format, better
    ("ppl", "perplexity", None, "token ppl ({data})", "float", "lower"),
    ("bpb", "bits_per_byte", None, "bits/byte ({data})", "float", "lower"),
    ("kl", "kl_mean", "kl_stderr", "KL vs {ref} ({data}, nats)", "float", "lower"),
    (
        "agree",
        "top1_agreement",
        "top1_agreement_stderr",
        "top-1 agreement ({data})",
        "pct",
        "higher",
    ),
)


def headline(score: TaskScore) -> tuple[str, float] | None:
    """(metric, value) a task is summarised by."""
    for name in HEADLINE:
        value = score.metric(name)
        if value is not None:
            return name, value
    return None


def task_score(evals: VariantEvals, task: str) -> TaskScore | None:
    return evals.quality.tasks.get(task) if evals.quality else None


def task_metric(measured: dict[str, VariantEvals], task: str) -> str | None:
    """The headline metric of `task` in the variants' lm-eval results."""
    for evals in measured.values():
        score = task_score(evals, task)
        top = headline(score) if score else None
        if top:
            return top[0]
    return None


def lower_is_better(metric: str) -> bool:
    return "perplexity" in metric


def describe_steps(manifest: Manifest) -> str:
    parts = []
    for step in manifest.steps:
        params = step.params
        detail = params.get("method") or (f"r={params['rank']}" if "rank" in params else "")
        if step.name == "distill":
            detail = f"{params.get('layers')} layers, {'KD' if params.get('kd') else 'CE'}"
        parts.append(f"{step.name}({detail})" if detail else step.name)
    return " + ".join(parts) or "identity"


def load_columns(load: LoadResult | None, reference_concurrency: int = 16) -> dict[str, Any]:
    """Peak throughput, p95 at the reference concurrency and saturation, per prompt length."""
    if not load:
        return {}
    row: dict[str, Any] = {
        "kv_bytes_per_token": load.server.kv_bytes_per_token,
        "kv_tokens": load.kv_tokens,
        "peak_output_tok_s": max(p.output_throughput for p in load.points),
        "peak_req_s": max(p.request_throughput for p in load.points),
    }
    for length, sat in load.saturation.items():
        point = load.at(int(length), reference_concurrency)
        row[f"p95_e2e_c{reference_concurrency}_p{length}"] = point.e2e.p95 if point else None
        row[f"saturation_p{length}"] = sat.measured_concurrency
        estimate = sat.estimated_concurrency
        row[f"saturation_estimate_p{length}"] = round(estimate, 1) if estimate is not None else None
    return row


def variant_row(name: str, manifest: Manifest, evals: VariantEvals) -> dict[str, Any]:
    ev = manifest.eval
    row: dict[str, Any] = {
        "variant": name,
        "kind": manifest.kind,
        "steps": describe_steps(manifest),
        "parameters": manifest.parameters,
        "trainable_parameters": (ev.trainable_parameters or None) if ev else None,
        "weight_bytes": ev.bytes_in_memory if ev else None,
        "bytes_on_disk": manifest.bytes_on_disk,
    }
    for task, score in (evals.quality.tasks if evals.quality else {}).items():
        top = headline(score)
        if top:
            row[task] = top[1]
            row[f"{task}_stderr"] = score.metric(f"{top[0]}_stderr")
        if score.bits_per_byte is not None:
            row[f"{task}_bits_per_byte"] = score.bits_per_byte
    for data, stats in (evals.divergence.data if evals.divergence else {}).items():
        for prefix, stat, stderr, *_ in DIVERGENCE:
            row[f"{prefix}_{data}"] = getattr(stats, stat)
            if stderr:
                row[f"{prefix}_{data}_stderr"] = getattr(stats, stderr)
    row.update(load_columns(evals.load))
    return row


def task_label(task: str, measured: dict[str, VariantEvals], lower: bool) -> str:
    """`task (acc, n=100, validation split)`: n and split of the first variant that has them."""
    for evals in measured.values():
        score = task_score(evals, task)
        if score:
            parts = ["word ppl" if lower else "acc", f"n={score.samples:.0f}"]
            if score.split is not None:
                parts.append(f"{score.split} split")
            return f"{task} ({', '.join(parts)})"
    return task


def divergence_columns(measured: dict[str, VariantEvals]) -> list[dict[str, Any]]:
    """Token perplexity, bits per byte, KL and top-1 agreement against the reference variant, per
    data set."""
    for evals in measured.values():
        div = evals.divergence
        if div:
            cols = []
            for data in div.data:
                for prefix, _, stderr, label, kind, better in DIVERGENCE:
                    col = {
                        "key": f"{prefix}_{data}",
                        "label": label.format(ref=div.reference, data=data),
                        "format": kind,
                        "better": better,
                    }
                    if stderr:
                        col["stderr_key"] = f"{prefix}_{data}_stderr"
                    cols.append(col)
            return cols
    return []


def add_recovery(
    rows: list[dict[str, Any]], tasks: list[str], measured: dict[str, VariantEvals]
) -> None:
    """`recovery_<task>` in percent against the base row (the variant named `base`, else the
    first); a row without the task gets None."""
    if not rows:
        return
    base = next((r for r in rows if r["variant"] == "base"), rows[0])
    for task in tasks:
        metric = task_metric(measured, task)
        for r in rows:
            value, ref = r.get(task), base.get(task)
            if value is None or not ref or metric is None:
                r[f"recovery_{task}"] = None
            elif lower_is_better(metric):
                bpb, ref_bpb = r.get(f"{task}_bits_per_byte"), base.get(f"{task}_bits_per_byte")
                r[f"recovery_{task}"] = 100.0 * ref_bpb / bpb if bpb and ref_bpb else None
            else:
                r[f"recovery_{task}"] = 100.0 * value / ref


def pareto_front(rows: list[dict[str, Any]], quality_key: str, lower_better: bool) -> list[str]:
    """Variants no other variant beats on both weight memory and quality (ties kept)."""

    def better_or_equal(a: dict, b: dict) -> bool:
        qa, qb = a[quality_key], b[quality_key]
        q_ok = qa <= qb if lower_better else qa >= qb
        return a["weight_bytes"] <= b["weight_bytes"] and q_ok

    usable = [r for r in rows if r.get(quality_key) is not None and r.get("weight_bytes")]
    front = []
    for r in usable:
        dominated = any(
            better_or_equal(o, r)
            and (o["weight_bytes"] < r["weight_bytes"] or o[quality_key] != r[quality_key])
            for o in usable
            if o is not r
        )
        if not dominated:
            front.append(r["variant"])
    return front


def columns(
    tasks: list[str], measured: dict[str, VariantEvals], load_settings: dict | None
) -> list[dict]:
    """The table's columns: key, label, unit format and which direction is better."""
    cols: list[dict[str, Any]] = [
        {"key": "variant", "label": "variant", "format": "text"},
        {"key": "steps", "label": "steps", "format": "text"},
        {"key": "parameters", "label": "params", "format": "int", "better": None},
        {"key": "weight_bytes", "label": "weight memory", "format": "bytes", "better": "lower"},
        {"key": "kv_bytes_per_token", "label": "KV B/token", "format": "int", "better": "lower"},
    ]
    for task in tasks:
        metric = task_metric(measured, task)
        if metric is None:
            continue
        lower = lower_is_better(metric)
        column = {
            "key": task,
            "label": task_label(task, measured, lower),
            "format": "float" if lower else "pct",
            "better": "lower" if lower else "higher",
        }
        if not lower:
            column["stderr_key"] = f"{task}_stderr"
        cols.append(column)
        cols.append(
            {
                "key": f"recovery_{task}",
                "label": f"{task} recovery{' (bits/byte)' if lower else ''}",
                "format": "pct100",
                "better": "higher",
            }
        )
    cols += divergence_columns(measured)
    return cols + load_settings_columns(load_settings)


def load_settings_columns(load_settings: dict | None) -> list[dict[str, Any]]:
    """Peak throughput, then p95 at 16 clients and saturation for each prompt length."""
    if not load_settings:
        return []
    cols: list[dict[str, Any]] = [
        {"key": "peak_output_tok_s", "label": "peak tok/s", "format": "float", "better": "higher"},
        {"key": "peak_req_s", "label": "peak req/s", "format": "float", "better": "higher"},
    ]
    for length in load_settings["prompt_len"]:
        cols += [
            {
                "key": f"p95_e2e_c16_p{length}",
                "label": f"p95 e2e s @c16 p{length}",
                "format": "float",
                "better": "lower",
            },
            {
                "key": f"saturation_p{length}",
                "label": f"saturation conc. p{length}",
                "format": "int",
                "better": "higher",
            },
            {
                "key": f"saturation_estimate_p{length}",
                "label": f"estimate p{length}",
                "format": "float",
                "better": None,
            },
        ]
    return cols

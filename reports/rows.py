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


def headline(metrics: dict[str, float]) -> tuple[str, float] | None:
    """(metric, value) a task is summarised by."""
    for name in HEADLINE:
        if name in metrics:
            return name, metrics[name]
    return None


def task_metric(quality: dict[str, Any], task: str) -> str | None:
    """The headline metric of `task` in the variants' lm-eval results ({variant: results})."""
    for results in quality.values():
        top = headline((results or {}).get("tasks", {}).get(task, {}))
        if top:
            return top[0]
    return None


def lower_is_better(metric: str) -> bool:
    return "perplexity" in metric


def describe_steps(manifest: dict[str, Any]) -> str:
    parts = []
    for step in manifest.get("steps", []):
        params = step.get("params", {})
        detail = params.get("method") or (f"r={params['rank']}" if "rank" in params else "")
        if step["name"] == "distill":
            detail = f"{params.get('layers')} layers, {'KD' if params.get('kd') else 'CE'}"
        parts.append(f"{step['name']}({detail})" if detail else step["name"])
    return " + ".join(parts) or "identity"


def _at(points: list[dict[str, Any]], prompt_len: int, concurrency: int) -> dict | None:
    return next(
        (p for p in points if p["prompt_len"] == prompt_len and p["concurrency"] == concurrency),
        None,
    )


def load_columns(load: dict[str, Any] | None, reference_concurrency: int = 16) -> dict[str, Any]:
    """Peak throughput, p95 at the reference concurrency and saturation, per prompt length."""
    if not load:
        return {}
    points = load["points"]
    row: dict[str, Any] = {
        "kv_bytes_per_token": load["server"].get("kv_bytes_per_token"),
        "kv_tokens": load["kv_tokens"],
        "peak_output_tok_s": max(p["output_throughput"] for p in points),
        "peak_req_s": max(p["request_throughput"] for p in points),
    }
    for length, sat in load["saturation"].items():
        point = _at(points, int(length), reference_concurrency)
        row[f"p95_e2e_c{reference_concurrency}_p{length}"] = point["e2e"]["p95"] if point else None
        row[f"saturation_p{length}"] = sat["measured_concurrency"]
        row[f"saturation_estimate_p{length}"] = round(sat["estimated_concurrency"], 1)
    return row


def variant_row(
    name: str,
    manifest: dict[str, Any],
    quality: dict[str, Any] | None,
    load: dict[str, Any] | None,
) -> dict[str, Any]:
    ev = manifest.get("eval", {})
    row: dict[str, Any] = {
        "variant": name,
        "kind": manifest.get("kind"),
        "steps": describe_steps(manifest),
        "parameters": manifest.get("parameters"),
        "trainable_parameters": ev.get("trainable_parameters") or None,
        "weight_bytes": ev.get("bytes_in_memory"),
        "bytes_on_disk": manifest.get("bytes_on_disk"),
    }
    for task, metrics in (quality or {}).get("tasks", {}).items():
        top = headline(metrics)
        if top:
            row[task] = top[1]
            row[f"{task}_stderr"] = metrics.get(f"{top[0]}_stderr")
        if "bits_per_byte" in metrics:
            row[f"{task}_bits_per_byte"] = metrics["bits_per_byte"]
    div = (quality or {}).get("divergence") or {}
    for data, stats in div.get("data", {}).items():
        for prefix, stat, stderr, *_ in DIVERGENCE:
            row[f"{prefix}_{data}"] = stats[stat]
            if stderr:
                row[f"{prefix}_{data}_stderr"] = stats[stderr]
    row.update(load_columns(load))
    return row


def task_label(task: str, quality: dict[str, Any], lower: bool) -> str:
    """`task (acc, n=100, validation split)`: n and split of the first variant that has them."""
    for results in quality.values():
        metrics = (results or {}).get("tasks", {}).get(task)
        if metrics:
            parts = ["word ppl" if lower else "acc", f"n={metrics['samples']:.0f}"]
            if "split" in metrics:
                parts.append(f"{metrics['split']} split")
            return f"{task} ({', '.join(parts)})"
    return task


def divergence_columns(quality: dict[str, Any]) -> list[dict[str, Any]]:
    """Token perplexity, bits per byte, KL and top-1 agreement against the reference variant, per
    data set."""
    for results in quality.values():
        div = (results or {}).get("divergence")
        if div:
            cols = []
            for data in div["data"]:
                for prefix, _, stderr, label, kind, better in DIVERGENCE:
                    col = {
                        "key": f"{prefix}_{data}",
                        "label": label.format(ref=div["reference"], data=data),
                        "format": kind,
                        "better": better,
                    }
                    if stderr:
                        col["stderr_key"] = f"{prefix}_{data}_stderr"
                    cols.append(col)
            return cols
    return []


def add_recovery(rows: list[dict[str, Any]], tasks: list[str], quality: dict[str, Any]) -> None:
    """`recovery_<task>` in percent against the base row (the variant named `base`, else the
    first); a row without the task gets None."""
    if not rows:
        return
    base = next((r for r in rows if r["variant"] == "base"), rows[0])
    for task in tasks:
        metric = task_metric(quality, task)
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


def columns(tasks: list[str], quality: dict[str, Any], load_settings: dict | None) -> list[dict]:
    """The table's columns: key, label, unit format and which direction is better."""
    cols: list[dict[str, Any]] = [
        {"key": "variant", "label": "variant", "format": "text"},
        {"key": "steps", "label": "steps", "format": "text"},
        {"key": "parameters", "label": "params", "format": "int", "better": None},
        {"key": "weight_bytes", "label": "weight memory", "format": "bytes", "better": "lower"},
        {"key": "kv_bytes_per_token", "label": "KV B/token", "format": "int", "better": "lower"},
    ]
    for task in tasks:
        metric = task_metric(quality, task)
        if metric is None:
            continue
        lower = lower_is_better(metric)
        column = {
            "key": task,
            "label": task_label(task, quality, lower),
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
    cols += divergence_columns(quality)
    if load_settings:
        cols += [
            {
                "key": "peak_output_tok_s",
                "label": "peak tok/s",
                "format": "float",
                "better": "higher",
            },
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

"""The recipe's report: `report.json` (every figure), `report.md` (the table) and `index.html`
(the table and the plots), written whole into `reports/<recipe>/`.

`report.json` holds, per variant, its table row, lm-eval results and load benchmark; the table's
columns; the Pareto front; the server check; how the figures were made (machine, packages).
"""

from __future__ import annotations

import datetime
import html
import json
import os
import platform
from pathlib import Path
from typing import Any

from compress.manifest import VariantResult
from evals.results import VariantEvals
from evals.settings import Evals
from evals.variant_evals import Measurements
from reports import figures
from reports.rows import (
    add_recovery,
    columns,
    lower_is_better,
    pareto_front,
    task_metric,
    variant_row,
)

SCHEMA = 1


def quality_axis(
    tasks: list[str], measured: dict[str, VariantEvals], columns: list[dict[str, Any]]
) -> tuple[str | None, bool]:
    """The table key the quality plot and Pareto front use: the first perplexity task, else the
    first data set's bits per byte from the divergence measurement, else the first task."""
    found = {t: m for t in tasks if (m := task_metric(measured, t))}
    for task, metric in found.items():
        if lower_is_better(metric):
            return task, True
    bpb = [c["key"] for c in columns if c["key"].startswith("bpb_")]
    if bpb:
        return bpb[0], True
    return (next(iter(found)), False) if found else (None, True)


def machine() -> dict[str, Any]:
    import torch

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def build_report(
    name: str,
    title: str | None,
    settings: Evals,
    variants: list[VariantResult],
    measurements: Measurements,
) -> dict[str, Any]:
    """The report of one run: `variants` in recipe order, each with what was measured of it."""
    tasks = settings.task_names()
    load_settings = settings.load.model_dump(mode="json") if settings.load else None
    measured = {v.name: measurements.of(v.name) for v in variants}
    rows = [variant_row(v.name, v.manifest, measured[v.name]) for v in variants]
    add_recovery(rows, tasks, measured)
    cols = columns(tasks, measured, load_settings)
    key, lower = quality_axis(tasks, measured, cols)
    return {
        "schema": SCHEMA,
        "recipe": name,
        "title": title or f"{name}: variants compared",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {"quality_tasks": tasks, "load": load_settings},
        "columns": cols,
        "variants": [
            {
                "name": v.name,
                "row": row,
                "manifest": {
                    "kind": v.manifest.kind,
                    "hash": v.manifest.hash,
                    "steps": [s.to_json() for s in v.manifest.steps],
                    "quantization": v.manifest.quantization,
                    **_plan_of(v.manifest.info),
                },
                "quality": measured[v.name].quality_json(),
                "load": load.to_json() if (load := measured[v.name].load) else None,
            }
            for v, row in zip(variants, rows, strict=True)
        ],
        "server_check": measurements.server_check.to_json() if measurements.server_check else None,
        "answers": {
            n: [a.to_json() for a in answers] for n, answers in measurements.answers.items()
        },
        "reused": measurements.reused,
        "quality_axis": {"key": key, "lower_is_better": lower},
        "pareto_front": pareto_front(rows, key, lower) if key else [],
    }


def _plan_of(info: dict[str, Any]) -> dict[str, Any]:
    """A mixed-precision variant's scan and plan, as its manifest records them."""
    keys = ("sensitivity", "plan", "predicted_kl", "measured_kl", "planned_bits_per_weight")
    return {k: info[k] for k in keys if k in info}


def entries(report: dict[str, Any], prefix: str = "") -> list[dict[str, Any]]:
    return [
        {"label": f"{prefix}{v['name']}", "row": v["row"], "load": v["load"]}
        for v in report["variants"]
    ]


def fmt(value: Any, kind: str) -> str:
    if value is None:
        return "–"
    if kind == "bytes":
        return f"{value / 1e6:.2f} MB"
    if kind == "int":
        return f"{value:,.0f}"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "pct100":
        return f"{value:.1f}%"
    if kind == "float":
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def cell(row: dict[str, Any], col: dict[str, Any]) -> str:
    """A table cell: the value, and ± its standard error where the column has one."""
    text = fmt(row.get(col["key"]), col["format"])
    stderr = row.get(col["stderr_key"]) if "stderr_key" in col else None
    if stderr is None or row.get(col["key"]) is None:
        return text
    if col["format"] == "pct":
        return f"{text} ± {100 * stderr:.1f}"
    return f"{text} ± {fmt(stderr, col['format'])}"


def answer_table(report: dict[str, Any]) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(prompt, [(variant, answer)])]: every variant's greedy answer to each chat prompt."""
    answers = report.get("answers") or {}
    names = [v["name"] for v in report["variants"] if v["name"] in answers]
    if not names:
        return []
    prompts = [a["prompt"] for a in answers[names[0]]]
    return [(p, [(n, answers[n][i]["answer"]) for n in names]) for i, p in enumerate(prompts)]


def markdown(report: dict[str, Any]) -> str:
    cols = report["columns"]
    lines = [f"# {report['title']}", ""]
    m = report["machine"]
    lines += [
        f"Created {report['created']} on {m['platform']}, {m['cpu_count']} CPUs, torch "
        f"{m['torch']}{', ' + m['cuda'] if m['cuda'] else ''}.",
        "",
        "| " + " | ".join(c["label"] for c in cols) + " |",
        "|" + "|".join("---" if c["format"] == "text" else "---:" for c in cols) + "|",
    ]
    for v in report["variants"]:
        lines.append("| " + " | ".join(cell(v["row"], c) for c in cols) + " |")
    lines += ["", f"Pareto front (weight memory vs {report['quality_axis']['key']}): "
              f"{', '.join(report['pareto_front']) or '–'}.", ""]  # fmt: skip
    for v in report["variants"]:
        if v["load"]:
            for length, sat in v["load"]["saturation"].items():
                lines.append(
                    f"- {v['name']}, prompt {length}: KV saturated at concurrency "
                    f"{sat['measured_concurrency'] or 'not reached'} (estimate "
                    f"{sat['estimated_concurrency']:.1f} from {v['load']['kv_tokens']:.0f} KV tokens)"
                )
    check = report.get("server_check")
    if check:
        lines += ["", f"Server check ({check['variant']}, lm-eval local-completions vs in-process, "
                  f"tolerance {check['abs_tol']} + {check['rel_tol']}·|ll| nats): "
                  f"{'agree' if check['ok'] else 'DISAGREE'}"]  # fmt: skip
        for task, t in check["tasks"].items():
            lines.append(
                f"- {task}: {t['requests']} requests, max |Δ| {t['max_abs_diff']:.2e} nats "
                f"(relative {t['max_rel_diff']:.1e})"
            )
    for prompt, rows in answer_table(report):
        lines += ["", f"### {prompt}", ""]
        lines += [f"- **{name}**: {' '.join(answer.split())}" for name, answer in rows]
    return "\n".join(lines) + "\n"


def html_table(report: dict[str, Any]) -> str:
    cols = report["columns"]
    head = "".join(f"<th>{html.escape(c['label'])}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell(v['row'], c))}</td>" for c in cols) + "</tr>"
        for v in report["variants"]
    )
    table = f"<table id='variants'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    return f"<div style='overflow-x:auto'>{table}</div>{html_answers(report)}"


def html_answers(report: dict[str, Any]) -> str:
    """Greedy chat answers side by side: one row per prompt, one column per variant."""
    rows = answer_table(report)
    if not rows:
        return ""
    head = "".join(f"<th>{html.escape(n)}</th>" for n, _ in rows[0][1])
    body = "".join(
        f"<tr><td>{html.escape(p)}</td>"
        + "".join(f"<td class='answer'>{html.escape(a)}</td>" for _, a in answers)
        + "</tr>"
        for p, answers in rows
    )
    return (
        "<h2>Greedy chat answers</h2><div style='overflow-x:auto'><table id='answers'>"
        f"<thead><tr><th>prompt</th>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<script src="plotly.min.js"></script>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}} td:first-child{{text-align:left}}
td.answer{{text-align:left;vertical-align:top;white-space:pre-wrap;min-width:14em}}</style>
</head><body><h1>{title}</h1><p>{subtitle}</p>{table}{plots}
<p>All figures: <a href="report.json">report.json</a>; table: <a href="report.md">report.md</a>.</p>
</body></html>
"""


def write_report(report: dict[str, Any], out_dir: Path) -> None:
    """report.json, report.md, index.html and plotly.min.js into `out_dir`, each whole."""
    from plotly.offline import get_plotlyjs

    out_dir.mkdir(parents=True, exist_ok=True)
    key, lower = report["quality_axis"]["key"], report["quality_axis"]["lower_is_better"]
    figs = figures.all_figures(entries(report), key, lower)
    for v in report["variants"]:
        if v["manifest"].get("sensitivity"):
            figs[f"sensitivity-{v['name']}"] = figures.sensitivity_heatmap(
                v["name"], v["manifest"]["sensitivity"], v["manifest"].get("plan", {})
            )
    plots = "".join(
        fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{name}")
        for name, fig in figs.items()
    )
    m = report["machine"]
    page = PAGE.format(
        title=html.escape(report["title"]),
        subtitle=html.escape(f"{report['created']}, {m['cpu_count']} CPUs, torch {m['torch']}"),
        table=html_table(report),
        plots=plots,
    )
    files = {
        "report.json": json.dumps(report, indent=2),
        "report.md": markdown(report),
        "index.html": page,
    }
    js = out_dir / "plotly.min.js"
    if not js.exists():
        js.with_suffix(".tmp").write_text(get_plotlyjs())
        js.with_suffix(".tmp").replace(js)
    for name, text in files.items():
        tmp = out_dir / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out_dir / name)

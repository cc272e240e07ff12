"""The recipe's report: `report.json` (every figure), `report.md` and `index.html` (the summary
figure, the recommendation, the problems, the grouped tables and the plots), written whole into
`reports/<recipe>/`.

`report.json` holds, per variant, its table row, lm-eval results and load benchmark; the columns
(`reports.metrics`); the paired comparisons against the reference (`reports.comparisons`); the
quality axis and its Pareto front; the recommendation (`reports.recommend`); the recipe's gates
judged on each variant (`reports.gates`) and the problems; the server check;
how the figures were made (machine, packages) and when the load results were measured
(`reports.sittings`).
"""

from __future__ import annotations

import datetime
import html
import json
import os
import platform
from pathlib import Path
from typing import Any

from compress.manifest import StepRecord
from evals.results import VariantEvals
from evals.settings import Evals
from evals.variant import VariantResult
from evals.variant_evals import Measurements
from reports import figures
from reports.comparisons import compare, reference_name, summary
from reports.gates import Gates, check
from reports.metrics import KL, SERVES_IN, VARIANT, VERDICTS, Metric, registry
from reports.recommend import recommendation
from reports.records import Report
from reports.render import html_tables, markdown
from reports.rows import add_recovery, pareto_front, variant_row
from reports.serves_in import serves_in
from reports.sittings import load_sittings

SCHEMA = 2


def seen_data(steps: list[StepRecord]) -> set[str]:
    """Named data sets a variant's steps trained or calibrated on (`data`, `replay_data`,
    anywhere in a step's parameters)."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if k in ("data", "replay_data") and isinstance(v, str):
                    found.add(v)
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for step in steps:
        walk(step.params)
    return found


def quality_axis(
    seen: dict[str, set[str]], metrics: list[Metric], measured: dict[str, VariantEvals]
) -> dict[str, Any]:
    """The quality plot's and Pareto front's axis: KL against the reference on the held-out data
    set the fewest variants trained or calibrated on (`seen`: each variant's `seen_data`; those
    are `excluded` from the front), else the first task's headline metric."""
    kl = [m for m in metrics if m.group == "divergence" and KL.owns(m.key)]
    if kl:
        axis = min(kl, key=lambda m: sum(m.source in s for s in seen.values()))
        excluded = [name for name, s in seen.items() if axis.source in s]
        return {"key": axis.key, "lower_is_better": True, "excluded": excluded}
    task = next((m for m in metrics if m.group == "quality" and m.measure), None)
    if task is None:
        return {"key": None, "lower_is_better": True, "excluded": []}
    return {"key": task.key, "lower_is_better": task.better == "lower", "excluded": []}


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
    gates: Gates | None = None,
) -> dict[str, Any]:
    """The report of one run: `variants` in recipe order, each with what was measured of it;
    `gates` (the recipe's) are checked on every variant but the reference."""
    tasks = settings.task_names()
    load_settings = settings.load.model_dump(mode="json") if settings.load else None
    measured = {v.name: measurements.of(v.name) for v in variants}
    rows = [
        variant_row(v.name, v.manifest, measured[v.name], v.serve)
        | {SERVES_IN.key: serves_in(v.path, v.manifest.kind)}
        for v in variants
    ]
    div_reference = settings.divergence.reference if settings.divergence else None
    reference = reference_name([v.name for v in variants], div_reference)
    add_recovery(rows, tasks, measured, reference)
    metrics = registry(tasks, measured, load_settings, reference)
    comparisons = compare(metrics, measured, reference) if reference else None
    for row in rows:
        if comparisons is not None and len(rows) > 1:
            row[VERDICTS] = summary(comparisons, row[VARIANT.key])
    seen = {v.name: seen_data(v.manifest.steps) for v in variants}
    axis = quality_axis(seen, metrics, measured)
    on_axis = [r for r in rows if r[VARIANT.key] not in axis["excluded"]]
    gated = check(gates or {}, rows, reference)
    report = {
        "schema": SCHEMA,
        "recipe": name,
        "title": title or f"{name}: variants compared",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {"quality_tasks": tasks, "load": load_settings},
        "columns": [m.column() for m in metrics],
        "variants": [
            _variant_json(v, row, seen[v.name], measured[v.name])
            for v, row in zip(variants, rows, strict=True)
        ],
        "server_check": measurements.server_check.to_json() if measurements.server_check else None,
        "answers": {
            n: [a.to_json() for a in answers] for n, answers in measurements.answers.items()
        },
        "reused": measurements.reused,
        "comparisons": comparisons,
        "quality_axis": axis,
        "pareto_front": (
            pareto_front(on_axis, axis["key"], axis["lower_is_better"]) if axis["key"] else []
        ),
    }
    report["load_sittings"] = load_sittings(report)
    report["recommendation"] = recommendation(Report.from_json(report)).sentences
    report["gates"] = [g.to_json() for g in gated]
    report["problems"] = problems(report) + [g.problem() for g in gated if not g.passed]
    return report


def _variant_json(
    v: VariantResult, row: dict[str, Any], seen: set[str], measured: VariantEvals
) -> dict[str, Any]:
    """report.json's entry of one variant: its row, serving settings, the data its steps saw,
    its manifest's summary, lm-eval results and load benchmark."""
    return {
        "name": v.name,
        "row": row,
        "serve": v.serve.model_dump(mode="json", exclude_defaults=True),
        "seen_data": sorted(seen),
        "manifest": {
            "kind": v.manifest.kind,
            "hash": v.manifest.hash,
            "steps": [s.to_json() for s in v.manifest.steps],
            "quantization": v.manifest.quantization,
            **_plan_of(v.manifest.info),
        },
        "quality": measured.quality_json(),
        "load": load.to_json() if (load := measured.load) else None,
    }


def problems(report: dict[str, Any]) -> list[str]:
    """What went wrong in measuring: failed requests at any load point, and a server check that
    disagrees with lm-eval in-process (with the failed gates, the report's `problems`: each makes
    the run's exit code non-zero, `reports.gates.exit_code`)."""
    out = []
    for v in report["variants"]:
        load = v["load"] or {}
        points = [*load.get("points", []), *(load.get("rate_points") or [])]
        points += [p for c in (load.get("capacity") or {}).values() for p in c["searched"]]
        for p in points:
            if p["failed"]:
                where = (
                    f"{p['request_rate']:g} req/s"
                    if p.get("request_rate")
                    else (f"concurrency {p['concurrency']}")
                )
                out.append(
                    f"{v['name']}: {p['failed']} of {p['failed'] + p['requests']} requests "
                    f"failed at {where}, prompt {p['prompt_len']}"
                )
    check = report.get("server_check")
    if check and not check["ok"]:
        out.append(f"server check on {check['variant']}: lm-eval through the server disagrees")
    return out


def _plan_of(info: dict[str, Any]) -> dict[str, Any]:
    """A mixed-precision variant's scan and plan, and a student's layers and their block
    influence, as its manifest records them."""
    keys = ("sensitivity", "plan", "predicted_kl", "measured_kl", "planned_bits_per_weight")
    out = {k: info[k] for k in (*keys, "kept_layers", "layer_selection") if k in info}
    if "layer_importance" in info:
        out["layer_importance"] = info["layer_importance"]["scores"]
    return out


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<script src="plotly.min.js"></script>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}} td:first-child{{text-align:left}}
td.answer{{text-align:left;vertical-align:top;white-space:pre-wrap;min-width:14em}}</style>
</head><body><h1>{title}</h1><p>{subtitle}</p>{summary}{table}{plots}
<p>All figures: <a href="report.json">report.json</a>; table: <a href="report.md">report.md</a>.</p>
</body></html>
"""


def write_report(document: dict[str, Any], out_dir: Path) -> None:
    """report.json, report.md, index.html and plotly.min.js into `out_dir`, each whole."""
    from plotly.offline import get_plotlyjs

    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report.from_json(document)
    figs = _figures(report)
    summary = figs.pop("summary", None)
    plots = "".join(_div(name, fig) for name, fig in figs.items())
    m = document["machine"]
    page = PAGE.format(
        title=html.escape(report.title),
        subtitle=html.escape(f"{report.created}, {m['cpu_count']} CPUs, torch {m['torch']}"),
        summary=_div("summary", summary) if summary else "",
        table=html_tables(report),
        plots=plots,
    )
    files = {
        "report.json": json.dumps(document, indent=2),
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


def _div(name: str, fig: Any) -> str:
    return str(fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"plot-{name}"))


def _figures(report: Report) -> dict[str, Any]:
    """{plot id: figure}: the summary figure (with a quality axis), the shared plots, then each
    mixed-precision variant's sensitivity and each student's layer influence."""
    key, lower = report.quality_axis.key, report.quality_axis.lower_is_better
    drawn = figures.entries(report)
    figs = {"summary": figures.summary(drawn, key, lower)} if key else {}
    figs |= figures.all_figures(drawn, key, lower)
    for v in report.variants:
        if v.manifest.get("sensitivity"):
            figs[f"sensitivity-{v.name}"] = figures.sensitivity_heatmap(
                v.name, v.manifest["sensitivity"], v.manifest.get("plan", {})
            )
        if v.manifest.get("layer_importance"):
            figs[f"layers-{v.name}"] = figures.layer_importance_bars(
                v.name, v.manifest["layer_importance"], v.manifest.get("kept_layers", [])
            )
    return figs

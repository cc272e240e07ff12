"""The report's plots (plotly), shared by `index.html` and the dashboard.

Every function takes `Entry`s (a variant's table row and its load benchmark, labelled `variant`
in a report and `run / variant` on the dashboard) and returns a figure; each variant is one trace
(one per prompt length in the load plots, in one legend group), except the summary figure's one
trace with a point per variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from reports.metrics import (
    CAPACITY_RATE,
    SATURATION,
    SATURATION_ESTIMATE,
    VARIANT,
    WEIGHT_BYTES,
)
from reports.records import Report
from reports.rows import pareto_front


@dataclass(frozen=True)
class Entry:
    """One variant as the plots draw it."""

    label: str
    """`variant` in a report, `run / variant` on the dashboard."""
    row: dict[str, Any]
    load: dict[str, Any] | None
    off_axis: bool = False
    """Trained or calibrated on the quality axis's data: drawn hollow, off the front."""


def entries(report: Report, prefix: str = "") -> list[Entry]:
    """The plots' entries of a report's variants, labelled `prefix + name`."""
    excluded = set(report.quality_axis.excluded)
    return [Entry(f"{prefix}{v.name}", v.row, v.load, v.name in excluded) for v in report.variants]


PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
)  # fmt: skip


def _colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def clients_at_saturation(entry: Entry, prompt_len: int | None) -> float | None:
    """Concurrent requests the variant's KV cache held when it saturated at `prompt_len`:
    measured, else estimated from its KV tokens; None without a load benchmark."""
    if prompt_len is None:
        return None
    measured = SATURATION.values(entry.row).get(str(prompt_len))
    return measured or SATURATION_ESTIMATE.values(entry.row).get(str(prompt_len))


def summary(entries: list[Entry], quality_key: str, lower_better: bool) -> go.Figure:
    """The report's opening figure: quality against weight memory with capacity, one trace with
    a point per variant (those with both figures); the marker's area grows with the clients its
    KV cache holds at saturation on the longest prompt measured (`customdata`)."""
    points = [
        e for e in entries if e.row.get(quality_key) is not None and e.row.get(WEIGHT_BYTES.key)
    ]
    lens = sorted({int(n) for e in points for n in SATURATION.values(e.row)})
    longest = lens[-1] if lens else None
    clients = [clients_at_saturation(e, longest) for e in points]
    top = max((c for c in clients if c), default=None)
    fig = go.Figure(
        go.Scatter(
            x=[e.row[WEIGHT_BYTES.key] / 1e6 for e in points],
            y=[e.row[quality_key] for e in points],
            mode="markers+text",
            text=[e.label for e in points],
            textposition="top center",
            customdata=clients,
            hovertemplate="%{text}: %{x:.2f} MB, %{y:.4g}, %{customdata} clients<extra></extra>",
            marker={
                "size": [14 if not (c and top) else 10 + 30 * (c / top) ** 0.5 for c in clients],
                "color": [_colour(i) for i in range(len(points))],
                "symbol": ["circle-open" if e.off_axis else "circle" for e in points],
            },
        )
    )
    where = f"clients at KV saturation, prompt {longest}" if longest else "no load benchmark"
    fig.update_layout(
        title=f"Quality against memory, with capacity (marker area: {where})",
        xaxis_title="weights in memory (MB)",
        yaxis_title=f"{quality_key} ({'lower' if lower_better else 'higher'} is better)",
    )
    return fig


def quality_vs_memory(entries: list[Entry], quality_key: str, lower_better: bool) -> go.Figure:
    """Quality against weight memory; the Pareto front (less memory and better quality than
    every other variant on at least one axis) as a line through its variants. Entries
    `off_axis` (trained on the axis's data) are drawn hollow and left off the front."""
    fig = go.Figure()
    rows = [
        {**e.row, VARIANT.key: e.label, "off_axis": e.off_axis}
        for e in entries
        if e.row.get(quality_key) is not None and e.row.get(WEIGHT_BYTES.key)
    ]
    for i, r in enumerate(rows):
        fig.add_trace(
            go.Scatter(
                x=[r[WEIGHT_BYTES.key] / 1e6],
                y=[r[quality_key]],
                mode="markers+text" if len(rows) <= 10 else "markers",  # labels, or hover
                name=r[VARIANT.key],
                text=[r[VARIANT.key]],
                textposition="top center",
                marker={
                    "size": 12,
                    "color": _colour(i),
                    "symbol": "circle-open" if r["off_axis"] else "circle",
                },
            )
        )
    on_axis = [r for r in rows if not r["off_axis"]]
    front = set(pareto_front(on_axis, quality_key, lower_better))
    points = sorted(
        (r[WEIGHT_BYTES.key] / 1e6, r[quality_key]) for r in rows if r[VARIANT.key] in front
    )
    fig.add_trace(
        go.Scatter(
            x=[p[0] for p in points],
            y=[p[1] for p in points],
            mode="lines",
            name="Pareto front",
            line={"dash": "dash", "color": "black"},
        )
    )
    fig.update_layout(
        title=f"{quality_key} against weight memory",
        xaxis_title="weights in memory (MB)",
        yaxis_title=f"{quality_key} ({'lower' if lower_better else 'higher'} is better)",
    )
    return fig


def _prompt_lens(entries: list[Entry]) -> list[int]:
    lens = {p["prompt_len"] for e in entries if e.load for p in e.load["points"]}
    return sorted(lens)


def _per_prompt_len(entries: list[Entry], metric: Any, title: str, y_title: str) -> go.Figure:
    lens = _prompt_lens(entries) or [0]
    fig = make_subplots(rows=1, cols=len(lens), subplot_titles=[f"prompt {n} tokens" for n in lens])
    for i, e in enumerate(entries):
        if not e.load:
            continue
        for col, length in enumerate(lens, start=1):
            points = sorted(
                (p for p in e.load["points"] if p["prompt_len"] == length),
                key=lambda p: p["concurrency"],
            )
            fig.add_trace(
                go.Scatter(
                    x=[p["concurrency"] for p in points],
                    y=[metric(p) for p in points],
                    mode="lines+markers",
                    name=e.label,
                    legendgroup=e.label,
                    showlegend=col == 1,
                    line={"color": _colour(i)},
                    meta={"prompt_len": length},
                ),
                row=1,
                col=col,
            )
    ticks = sorted({p["concurrency"] for e in entries if e.load for p in e.load["points"]})
    fig.update_xaxes(type="log", tickvals=ticks, ticktext=[str(t) for t in ticks])
    fig.update_xaxes(title_text="concurrent clients")
    fig.update_yaxes(title_text=y_title, col=1)
    fig.update_layout(title=title)
    return fig


def throughput_vs_concurrency(entries: list[Entry]) -> go.Figure:
    return _per_prompt_len(
        entries, lambda p: p["output_throughput"], "Output throughput", "output tokens / s"
    )


def p95_vs_concurrency(entries: list[Entry]) -> go.Figure:
    return _per_prompt_len(
        entries, lambda p: p["e2e"]["p95"], "p95 end-to-end latency", "seconds (p95)"
    )


def kv_vs_concurrency(entries: list[Entry]) -> go.Figure:
    """Peak KV usage per point; the estimated saturation (KV tokens / (prompt + output)) as a
    dotted line per variant, the measured one as a star."""
    fig = _per_prompt_len(
        entries, lambda p: 100 * p["peak_kv_usage"], "Peak KV cache usage", "KV cache used (%)"
    )
    lens = _prompt_lens(entries)
    for i, e in enumerate(entries):
        if not e.load:
            continue
        for col, length in enumerate(lens, start=1):
            sat = e.load["saturation"].get(str(length))
            if not sat:
                continue
            fig.add_trace(
                go.Scatter(
                    x=[sat["estimated_concurrency"]] * 2,
                    y=[0, 100],
                    mode="lines",
                    name=f"{e.label} estimate",
                    legendgroup=e.label,
                    showlegend=False,
                    line={"dash": "dot", "color": _colour(i)},
                    meta={"prompt_len": length, "role": "estimate"},
                ),
                row=1,
                col=col,
            )
            measured = sat["measured_concurrency"]
            point = next(
                (
                    p
                    for p in e.load["points"]
                    if p["prompt_len"] == length and p["concurrency"] == measured
                ),
                None,
            )
            if point:
                fig.add_trace(
                    go.Scatter(
                        x=[measured],
                        y=[100 * point["peak_kv_usage"]],
                        mode="markers",
                        name=f"{e.label} saturated",
                        legendgroup=e.label,
                        showlegend=False,
                        marker={"symbol": "star", "size": 16, "color": _colour(i)},
                        meta={"prompt_len": length, "role": "measured"},
                    ),
                    row=1,
                    col=col,
                )
    fig.update_yaxes(range=[0, 105])
    return fig


def capacity_vs_quality(entries: list[Entry], quality_key: str, lower_better: bool) -> go.Figure:
    """Per prompt length with an SLO, each variant's highest request rate within it against the
    quality axis (one trace per variant, one marker per prompt length)."""
    fig = go.Figure()
    for i, e in enumerate(entries):
        rates = sorted((int(n), v) for n, v in CAPACITY_RATE.values(e.row).items() if v is not None)
        quality = e.row.get(quality_key)
        if not rates or quality is None:
            continue
        fig.add_trace(
            go.Scatter(
                x=[r for _, r in rates],
                y=[quality] * len(rates),
                text=[f"prompt {n}" for n, _ in rates],
                mode="markers",
                name=e.label,
                marker={"size": 12, "color": _colour(i),
                        "symbol": "circle-open" if e.off_axis else "circle"},
            )
        )  # fmt: skip
    fig.update_layout(
        title="Capacity within the SLO against quality",
        xaxis_title="highest request rate within the SLO (req/s)",
        yaxis_title=f"{quality_key} ({'lower' if lower_better else 'higher'} is better)",
    )
    return fig


def all_figures(entries: list[Entry], quality_key: str | None, lower_better: bool) -> dict:
    """{plot id: figure}; the quality plot only when a quality metric exists, the load plots
    only when some entry has a load benchmark, the capacity plot only when one has a capacity."""
    figs: dict[str, go.Figure] = {}
    if quality_key:
        figs["quality"] = quality_vs_memory(entries, quality_key, lower_better)
        if any(CAPACITY_RATE.values(e.row) for e in entries):
            figs["capacity"] = capacity_vs_quality(entries, quality_key, lower_better)
    if any(e.load for e in entries):
        figs["throughput"] = throughput_vs_concurrency(entries)
        figs["latency"] = p95_vs_concurrency(entries)
        figs["kv"] = kv_vs_concurrency(entries)
    return figs


def sensitivity_heatmap(
    name: str, sensitivity: dict[str, dict[str, float]], plan: dict[str, str]
) -> go.Figure:
    """Per candidate format, the KL when only that part (layer x module kind) is quantized to it,
    on a log colour scale; a dot marks the format the mixed plan gave the part."""
    import math

    kinds = ["attn_in", "attn_out", "mlp_in", "mlp_out"]
    layers = sorted({int(p.split(".")[0]) for p in sensitivity})
    formats = list(next(iter(sensitivity.values()))) if sensitivity else []
    formats = [f for f in formats if f != "keep"]
    fig = make_subplots(
        rows=1, cols=max(len(formats), 1), subplot_titles=formats, shared_yaxes=True
    )
    for i, fmt in enumerate(formats):
        z = [[sensitivity.get(f"{layer}.{k}", {}).get(fmt) for k in kinds] for layer in layers]
        fig.add_trace(
            go.Heatmap(
                z=[[math.log10(v) if v and v > 0 else None for v in row] for row in z],
                x=kinds,
                y=[str(layer) for layer in layers],
                text=[
                    ["●" if plan.get(f"{layer}.{k}") == fmt else "" for k in kinds]
                    for layer in layers
                ],
                texttemplate="%{text}",
                customdata=z,
                hovertemplate="layer %{y} %{x}: KL %{customdata:.2e}<extra>" + fmt + "</extra>",
                coloraxis="coloraxis",
            ),
            row=1,
            col=i + 1,
        )
    fig.update_layout(
        title=f"{name}: sensitivity (log10 KL when one part is quantized; ● = the plan's choice)",
        coloraxis={"colorscale": "Viridis", "colorbar": {"title": "log10 KL"}},
        yaxis={"title": "layer", "autorange": "reversed"},
        height=max(300, 24 * len(layers) + 140),
    )
    return fig


def layer_importance_bars(name: str, scores: list[float], kept: list[int]) -> go.Figure:
    """Block influence of every teacher layer, the layers the student kept filled, the dropped
    ones hollow."""
    chosen = set(kept)
    fig = go.Figure(
        go.Bar(
            x=list(range(len(scores))),
            y=scores,
            marker={
                "color": [
                    "#1f77b4" if i in chosen else "rgba(0,0,0,0)" for i in range(len(scores))
                ],
                "line": {"color": "#1f77b4", "width": 1.5},
            },
            customdata=["kept" if i in chosen else "dropped" for i in range(len(scores))],
            hovertemplate="layer %{x}: %{y:.4f} (%{customdata})<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"{name}: block influence per teacher layer (1 - cos(in, out); filled = kept)",
        xaxis={"title": "teacher layer", "dtick": 1},
        yaxis={"title": "block influence"},
        height=320,
    )
    return fig

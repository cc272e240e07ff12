"""Which load results were measured together: throughput and latency of one machine drift
between sittings, so the report says when its serving figures come from more than one.

Model: a sitting is a run of load measurements on one machine (host, CPU model, CPU count) with
no gap longer than `GAP` between one's end and the next one's start. A result stored without its
time (an older workbench's) is a sitting of its own, of unknown time.
"""

from __future__ import annotations

import datetime
from typing import Any

from evals.results import Sitting

GAP = datetime.timedelta(minutes=20)
"""Longer than any pause between two variants' ramps within one recipe run (a server start)."""


def load_sittings(report: dict[str, Any]) -> list[dict[str, Any]]:
    """[{variants, started, ended, host, cpu, cpu_count}] in time order; an unknown one
    (`started` None) last."""
    timed: list[tuple[str, Sitting]] = []
    unknown = []
    for v in report["variants"]:
        load = v.get("load")
        if not load:
            continue
        if load.get("measured"):
            timed.append((v["name"], Sitting.from_json(load["measured"])))
        else:
            unknown.append(v["name"])
    groups: list[list[tuple[str, Sitting]]] = []
    for name, s in sorted(timed, key=lambda t: t[1].start()):
        g = groups[-1] if groups else None
        if g and _machine(g[-1][1]) == _machine(s) and s.start() - _end(g) <= GAP:
            g.append((name, s))
        else:
            groups.append([(name, s)])
    out = [
        {
            "variants": [n for n, _ in g],
            "started": g[0][1].started,
            "ended": _end(g).isoformat(timespec="seconds"),
            "host": g[0][1].host,
            "cpu": g[0][1].cpu,
            "cpu_count": g[0][1].cpu_count,
        }
        for g in groups
    ]
    if unknown:
        out.append({"variants": unknown, "started": None})
    return out


def _end(group: list[tuple[str, Sitting]]) -> datetime.datetime:
    return max(s.end() for _, s in group)


def _machine(s: Sitting) -> tuple[str, str, int]:
    return (s.host, s.cpu, s.cpu_count)


def sitting_lines(report: dict[str, Any]) -> list[str]:
    """One line per sitting when the load results come from more than one; none otherwise."""
    sittings = report.get("load_sittings") or []
    if len(sittings) < 2:
        return []
    lines = [
        f"Load results from {len(sittings)} sittings: compare throughput and latency across "
        "them only roughly (rerun the variants with --force to measure them in one)."
    ]
    for s in sittings:
        names = ", ".join(s["variants"])
        if s["started"] is None:
            lines.append(f"{names}: measured at an unknown time (stored by an older workbench)")
        else:
            start, end = (datetime.datetime.fromisoformat(s[k]) for k in ("started", "ended"))
            when = f"{start:%Y-%m-%d %H:%M} to {end:%H:%M} UTC"
            lines.append(f"{names}: {when} on {s['host']} ({s['cpu']}, {s['cpu_count']} CPUs)")
    return lines


def twin_lines(report: dict[str, Any]) -> list[str]:
    """One line per variant whose load figures are a serving twin's (`evals.serving_twins`)."""
    lines = []
    for v in report["variants"]:
        source = (v.get("load") or {}).get("measured_on")
        if source:
            lines.append(
                f"{v['name']}: serving figures measured on {source}, its serving twin (the same "
                "shapes, formats and serve settings; the load requests do not depend on the "
                "weights' values)"
            )
    return lines

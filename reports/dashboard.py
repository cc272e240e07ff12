"""`workbench dashboard [reports/]`: one page comparing every run's variants.

Model: a run is a directory `<reports>/<run>/` holding a `report.json`; the directory is read on
every request, so a report written while the dashboard runs appears on reload. The page
(`dashboard.html`) asks `/api/runs` what exists and `/api/compare` for the chosen runs and
variants: the union of their table columns, one row per variant labelled `run / variant`, and
the report's plots (`reports.figures`, the summary figure first) over exactly those variants,
each run's problems (failed requests, failed gates), and each run's paired
comparisons of those variants against that run's reference (pairs never cross runs: the items
are the same only within one). `Filters` (a memory budget,
a p95 latency bound, a minimum capacity within the run's SLO) keep only the variants known to
meet them: a variant without the figure a filter reads is hidden while that filter is set.
"""

from __future__ import annotations

import functools
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse, JSONResponse, Response

from reports import figures
from reports.metrics import CAPACITY_RATE, P95_E2E, WEIGHT_BYTES
from reports.records import Report, ReportFormatError
from reports.render import COMPARISON_HEAD, comparison_rows
from serve.http.middleware import CrossSiteGuard

PAGE = Path(__file__).with_name("dashboard.html")


def load_runs(root: Path) -> dict[str, Report]:
    """{run: report} for every readable `<root>/*/report.json`, by run name."""
    return scan_runs(root)[0]


def scan_runs(root: Path) -> tuple[dict[str, Report], list[dict[str, str]]]:
    """The usable reports by run name, and a note ({file, problem}) for each `report.json`
    that is not one: a file that cannot be read (not a regular file, too large, not JSON) or
    that is JSON but not a report (or whose contents the page cannot show) is skipped, so one
    bad file never empties the page. Reports are written whole (`reports.report.write_report`
    renames them into place), so a file that does not parse is not one being written."""
    runs: dict[str, Report] = {}
    skipped: list[dict[str, str]] = []
    for path in sorted(root.glob("*/report.json")):
        report, problem = _checked_report(path)
        if report is not None:
            runs[path.parent.name] = report
        else:
            skipped.append({"file": str(path), "problem": problem or "not a report"})
    return runs, skipped


MAX_REPORT_BYTES = 64 << 20
"""Largest report.json read (a report of a recipe's variants, with its plots' data, is well
under 1 MB); a larger file is skipped unread."""

_CHECKED: dict[Path, tuple[tuple[int, int], Report | None, str | None]] = {}
"""report.json path -> ((mtime_ns, size), report, problem): a file is read and checked once
until it changes, not on every request."""


class Unreadable(Exception):
    """Why a report.json was not read: the note /api/skipped shows."""


def _checked_report(path: Path) -> tuple[Report | None, str | None]:
    """The report at `path` and None, or None and why it is not one."""
    try:
        version = regular_file_version(os.stat(path), MAX_REPORT_BYTES)
        cached = _CHECKED.get(path)
        if cached is not None and cached[0] == version:
            return cached[1], cached[2]
        document = json.loads(read_regular_file(path, MAX_REPORT_BYTES))
    except Unreadable as e:
        return None, str(e)
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"is not JSON ({e})"
    except RecursionError:
        return None, "is not a report: its JSON nests deeper than the parser takes"
    problem = report_problem(path.parent.name, document)
    report = Report.from_json(document) if problem is None else None
    _CHECKED[path] = (version, report, problem)
    return report, problem


def regular_file_version(info: os.stat_result, limit: int) -> tuple[int, int]:
    """(mtime_ns, size) of a regular file of at most `limit` bytes; Unreadable for anything
    else (a FIFO would block its reader, a device may never end)."""
    if not stat.S_ISREG(info.st_mode):
        kind = _KINDS.get(stat.S_IFMT(info.st_mode), "special file")
        raise Unreadable(f"is a {kind}, not a regular file: the dashboard reads regular files only")
    if info.st_size > limit:
        raise Unreadable(f"is {info.st_size:,} bytes, over the {limit:,} bytes a report may have")
    return info.st_mtime_ns, info.st_size


_KINDS = {
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFDIR: "directory",
}


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes; Unreadable otherwise.
    Opened non-blocking and checked again on the open file, so a file swapped for a FIFO
    between the check and the open cannot block the reader either."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        regular_file_version(os.fstat(fd), limit)
        data = f.read(limit + 1)
    if len(data) > limit:
        raise Unreadable(f"grew over the {limit:,} bytes a report may have while it was read")
    return data


def report_problem(run: str, report: Any) -> str | None:
    """None when `report` can be listed and compared; else what is wrong with it."""
    if not isinstance(report, dict):
        return f"holds a JSON {type(report).__name__}, not a report object"
    missing = [k for k in ("title", "created", "columns", "variants") if k not in report]
    if missing:
        return f"not a workbench report: no {', '.join(missing)}"
    try:
        compare({run: Report.from_json(report)}, [run], None)
    except (ReportFormatError, KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        return f"not a workbench report the dashboard can show ({type(e).__name__}: {e})"
    return None


@dataclass(frozen=True)
class Filters:
    budget_mb: float | None = None
    """Weight memory at most this many MB."""
    max_e2e_p95_s: float | None = None
    """p95 end-to-end latency at 16 clients at most this, at every prompt length measured."""
    min_slo_rate: float | None = None
    """Request rate within the run's SLO at least this, at every prompt length measured."""

    def passes(self, row: dict[str, Any]) -> bool:
        if self.budget_mb is not None:
            weights = row.get(WEIGHT_BYTES.key)
            if weights is None or weights > self.budget_mb * 1e6:
                return False
        if self.max_e2e_p95_s is not None:
            e2e = [v for v in P95_E2E.values(row).values() if v is not None]
            if not e2e or max(e2e) > self.max_e2e_p95_s:
                return False
        if self.min_slo_rate is not None:
            rates = list(CAPACITY_RATE.values(row).values())
            if not rates or any(r is None or r < self.min_slo_rate for r in rates):
                return False
        return True


PAIRED_HEAD = [COMPARISON_HEAD[0], "paired with", *COMPARISON_HEAD[1:]]


def paired_rows(report: Report, run: str, shown: set[str]) -> list[dict[str, Any]]:
    """The run's paired comparisons (report.md's table, the same cells) of the variants shown:
    each against its own run's reference, measured on the same items."""
    reference = f"{run} / {report.comparisons.reference}"
    out = []
    for cells, r in zip(comparison_rows(report), report.comparisons.rows, strict=True):
        label = f"{run} / {r.variant}"
        if label in shown:
            out.append({"label": label, "metric": r.metric, "verdict": r.verdict,
                        "cells": [label, reference, *cells[1:]]})  # fmt: skip
    return out


def compare(
    runs: dict[str, Report],
    chosen_runs: list[str],
    chosen: set[str] | None,
    filters: Filters | None = None,
) -> dict[str, Any]:
    """Columns, rows, paired comparisons, problems and figures for the chosen runs; `chosen` =
    labels `run / variant` to keep (None: all); `hidden`: the chosen variants `filters` left
    out; `problems`: each chosen run's (failed requests, failed gates), `run: problem`."""
    filters = filters or Filters()
    columns: list[dict[str, Any]] = []
    seen: set[str] = set()
    picked, rows, hidden = [], [], []
    for run in chosen_runs:
        report = runs[run]
        for c in report.document["columns"]:
            if c["key"] not in seen:
                seen.add(c["key"])
                columns.append(c)
        for e in figures.entries(report, prefix=f"{run} / "):
            if chosen is not None and e.label not in chosen:
                continue
            if not filters.passes(e.row):
                hidden.append(e.label)
                continue
            picked.append(e)
            rows.append({**e.row, "label": e.label, "run": run})
    shown = {e.label for e in picked}
    paired = [p for run in chosen_runs for p in paired_rows(runs[run], run, shown)]
    axis = runs[chosen_runs[0]].quality_axis if chosen_runs else None
    key, lower = (axis.key, axis.lower_is_better) if axis else (None, True)
    figs = {"summary": figures.summary(picked, key, lower)} if key else {}
    figs |= figures.all_figures(picked, key, lower)
    columns.insert(0, {"key": "run", "label": "run", "format": "text"})
    return {
        "columns": columns,
        "rows": rows,
        "hidden": hidden,
        "paired_head": PAIRED_HEAD,
        "paired": paired,
        "problems": [f"{run}: {p}" for run in chosen_runs for p in runs[run].problems],
        "figures": {name: json.loads(fig.to_json()) for name, fig in figs.items()},
    }


@functools.cache
def plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def build_app(
    root: Path,
    bind_host: str = "127.0.0.1",
    allowed_hosts: str | None = None,
    allowed_origins: str | None = None,
) -> FastAPI:
    """The page and its API over `root`, behind the server's cross-site guard: on a loopback
    address only loopback Host names (and `allowed_hosts`) are answered, so a page whose name
    was rebound to 127.0.0.1 reads nothing, and no foreign origin (beyond `allowed_origins`)
    gets an answer."""
    app = FastAPI(title="workbench dashboard")
    app.add_middleware(
        CrossSiteGuard,
        allowed_origins=allowed_origins,
        allowed_hosts=allowed_hosts,
        bind_host=bind_host,
    )

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE.read_text()

    @app.get("/favicon.ico")
    def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/plotly.min.js")
    def plotly() -> Response:
        return Response(plotly_js(), media_type="application/javascript")

    @app.get("/api/runs")
    def list_runs() -> JSONResponse:
        return JSONResponse(
            [
                {
                    "run": run,
                    "title": r.title,
                    "created": r.created,
                    "variants": [v.name for v in r.variants],
                }
                for run, r in load_runs(root).items()
            ]
        )

    @app.get("/api/skipped")
    def list_skipped() -> JSONResponse:
        return JSONResponse(scan_runs(root)[1])

    @app.get("/api/compare")
    def compare_route(
        runs: str = Query("", description="comma-separated run names"),
        variants: str | None = Query(None, description="comma-separated `run / variant` labels"),
        budget_mb: float | None = Query(None, gt=0, description="weight memory at most (MB)"),
        max_e2e_p95_s: float | None = Query(None, gt=0, description="p95 e2e at 16 clients"),
        min_slo_rate: float | None = Query(None, ge=0, description="req/s within the SLO"),
    ) -> JSONResponse:
        available = load_runs(root)
        chosen_runs = list(dict.fromkeys(r for r in runs.split(",") if r))  # each run once
        unknown = [r for r in chosen_runs if r not in available]
        if unknown:
            known = ", ".join(available) or "none"
            raise HTTPException(
                404, f"no report for run(s) {', '.join(unknown)} in {root}; known: {known}"
            )
        chosen = None if variants is None else {v for v in variants.split(",") if v}
        filters = Filters(budget_mb, max_e2e_p95_s, min_slo_rate)
        return JSONResponse(compare(available, chosen_runs, chosen, filters))

    return app


def serve_dashboard(
    root: Path,
    host: str,
    port: int,
    allowed_hosts: str | None = None,
    allowed_origins: str | None = None,
) -> None:
    import uvicorn

    if not root.is_dir():
        raise SystemExit(f"workbench dashboard: {root} is not a directory; give the reports dir")
    runs, skipped = scan_runs(root)
    print(f"dashboard over {len(runs)} run(s) in {root}: http://{host}:{port}/")
    for note in skipped:
        print(f"  skipped {note['file']}: {note['problem']}")
    app = build_app(root, host, allowed_hosts, allowed_origins)
    uvicorn.run(app, host=host, port=port, log_level="warning")

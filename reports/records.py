"""The report's records: report.json typed, as the renderer, the recommendation, the dashboard
and the CLI read it.

Model: `reports.report.build_report` writes report.json; every reader parses it once with
`Report.from_json` and reads fields, never string keys of the document. A row's values stay keyed
by the metric registry's keys (`reports.metrics`): `VariantRow.value(metric)` reads one. Reports
written before a field existed (no `gates`, no `seen_data`, no `load_sittings`) read with that
field empty; a document missing what every report has (`variants`, a variant's `name` or `row`)
raises `ReportFormatError` naming it, which the dashboard shows as the file's note.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reports.gates import GateResult
from reports.metrics import VARIANT, WEIGHT_BYTES, Metric


class ReportFormatError(ValueError):
    """report.json lacks a field every report has, or holds it in the wrong shape."""


def _need(doc: Any, key: str, where: str) -> Any:
    if not isinstance(doc, dict):
        raise ReportFormatError(f"{where}: found a JSON {type(doc).__name__}, not an object")
    if key not in doc:
        raise ReportFormatError(f"{where}: no {key!r}")
    return doc[key]


@dataclass(frozen=True)
class Column:
    """One metric as report.json `columns` lists it (`reports.metrics.Metric.column`)."""

    key: str
    label: str
    format: str
    better: str | None = None
    group: str | None = None
    stderr_key: str | None = None
    short: str | None = None

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Column:
        return cls(
            _need(doc, "key", "columns[]"),
            doc.get("label", doc["key"]),
            doc.get("format", "text"),
            doc.get("better"),
            doc.get("group"),
            doc.get("stderr_key"),
            doc.get("short"),
        )


@dataclass(frozen=True)
class VariantRow:
    """One variant: its table row (values by metric key) and what was measured of it."""

    name: str
    row: dict[str, Any]
    serve: dict[str, Any] = field(default_factory=dict)
    """Serving settings beyond the defaults (`kv_cache_dtype: int8`); empty when plain."""
    seen_data: frozenset[str] = frozenset()
    """Data sets its steps trained or calibrated on."""
    manifest: dict[str, Any] = field(default_factory=dict)
    load: dict[str, Any] | None = None
    """The load benchmark as `evals.results.LoadResult.to_json` stores it."""

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> VariantRow:
        name = _need(doc, "name", "variants[]")
        row = _need(doc, "row", f"variant {name!r}")
        if not isinstance(row, dict):
            raise ReportFormatError(f"variant {name!r}: its row is not an object")
        return cls(
            name,
            row,
            doc.get("serve") or {},
            frozenset(doc.get("seen_data") or ()),
            doc.get("manifest") or {},
            doc.get("load"),
        )

    def value(self, metric: Metric | str) -> Any:
        return self.row.get(metric if isinstance(metric, str) else metric.key)

    @property
    def weight_bytes(self) -> float | None:
        return self.row.get(WEIGHT_BYTES.key)

    def relabelled(self, label: str) -> dict[str, Any]:
        """The row under another variant name (the dashboard's `run / variant`)."""
        return {**self.row, VARIANT.key: label}


@dataclass(frozen=True)
class Comparison:
    """One paired difference of a variant against the reference (`reports.comparisons`)."""

    variant: str
    metric: str
    pairing: str
    delta: float
    low: float
    high: float
    p: float
    p_adjusted: float
    mde: float
    verdict: str
    better: str | None = None
    data: str | None = None
    """The divergence data set of a window comparison."""

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Comparison:
        def need(key: str) -> Any:
            return _need(doc, key, "comparisons.rows[]")

        return cls(
            need("variant"), need("metric"), need("pairing"), need("delta"), need("low"),
            need("high"), need("p"), need("p_adjusted"), need("mde"), doc.get("verdict", ""),
            doc.get("better"), doc.get("data"),
        )  # fmt: skip


@dataclass(frozen=True)
class Comparisons:
    reference: str | None = None
    alpha: float = 0.05
    adjustment: str = ""
    rows: list[Comparison] = field(default_factory=list)

    @classmethod
    def from_json(cls, doc: dict[str, Any] | None) -> Comparisons:
        if not doc:
            return cls()
        rows = [Comparison.from_json(r) for r in doc.get("rows", [])]
        return cls(doc.get("reference"), doc.get("alpha", 0.05), doc.get("adjustment", ""), rows)


@dataclass(frozen=True)
class QualityAxis:
    """The quality plot's and Pareto front's metric (`reports.report.quality_axis`)."""

    key: str | None = None
    lower_is_better: bool = True
    excluded: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, doc: dict[str, Any] | None) -> QualityAxis:
        doc = doc or {}
        return cls(doc.get("key"), bool(doc.get("lower_is_better", True)),
                   tuple(doc.get("excluded") or ()))  # fmt: skip


@dataclass(frozen=True)
class Recommendation:
    """The recommendation's sentences (`reports.recommend`), `**name**` marking a variant."""

    sentences: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Report:
    """One run's report.json, typed; fields beyond these stay in `document`."""

    title: str
    created: str
    columns: list[Column]
    variants: list[VariantRow]
    comparisons: Comparisons
    quality_axis: QualityAxis
    pareto_front: list[str]
    recommendation: Recommendation
    problems: list[str]
    load_sittings: list[dict[str, Any]]
    gates: list[GateResult]
    """Every gate of the recipe on every variant but the reference (`reports.gates`)."""
    document: dict[str, Any]
    """The whole report.json (machine, server check, answers: read where they are shown)."""

    @classmethod
    def from_json(cls, doc: Any) -> Report:
        variants = [VariantRow.from_json(v) for v in _need(doc, "variants", "report")]
        return cls(
            doc.get("title", ""),
            doc.get("created", ""),
            [Column.from_json(c) for c in doc.get("columns", [])],
            variants,
            Comparisons.from_json(doc.get("comparisons")),
            QualityAxis.from_json(doc.get("quality_axis")),
            list(doc.get("pareto_front") or []),
            Recommendation(list(doc.get("recommendation") or [])),
            list(doc.get("problems") or []),
            list(doc.get("load_sittings") or []),
            [GateResult.from_json(g) for g in doc.get("gates") or []],
            doc,
        )

    def labels(self) -> dict[str, str]:
        """{metric key: its label}."""
        return {c.key: c.label for c in self.columns}

    def label(self, key: str) -> str:
        return self.labels().get(key, key)

    def variant(self, name: str) -> VariantRow | None:
        return next((v for v in self.variants if v.name == name), None)

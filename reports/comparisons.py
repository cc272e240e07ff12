"""Every variant against the reference variant, metric by metric, as paired data.

Model: for each metric of the registry that declares a pairing, each variant's scores and the
reference's on the same items (lm-eval documents matched by id; divergence windows, which the
variant's divergence record holds for both models) give an `evals.paired.Paired`. All p-values of a
report are adjusted together (Benjamini-Hochberg across tasks x variants), and each difference is
classed `better`, `worse` or `no detectable difference` at alpha 0.05 after adjustment, with the
smallest difference its n could have detected beside it. Units: accuracy differences in points
of accuracy (fractions), bits-per-byte differences in bits per byte, window differences in nats
of NLL per token (`exp` gives the perplexity ratio).
"""

from __future__ import annotations

import math
from typing import Any

from evals import paired
from evals.results import ItemScores, VariantEvals
from reports.metrics import Metric
from reports.records import Comparison


def reference_name(names: list[str], divergence_reference: str | None) -> str | None:
    """The variant every other one is compared with: the divergence reference, else `base`,
    else the first."""
    for candidate in (divergence_reference, "base"):
        if candidate in names:
            return candidate
    return names[0] if names else None


def _items(evals: VariantEvals, task: str) -> ItemScores | None:
    """A variant's per-document scores of `task` (None: not measured, or stored without them)."""
    return evals.quality.items.get(task) if evals.quality and evals.quality.items else None


def _accuracy(metric: Metric, ref: VariantEvals, var: VariantEvals) -> paired.Paired | None:
    task, measure = metric.source or "", metric.measure or ""
    a, b = _items(ref, task), _items(var, task)
    if a is None or b is None:
        return None
    a_scores, b_scores = a.metric(measure), b.metric(measure)
    if a_scores is None or b_scores is None:
        return None
    by_id = dict(zip(b.ids, b_scores, strict=True))
    common = [(s, by_id[i]) for i, s in zip(a.ids, a_scores, strict=True) if i in by_id]
    if not common:
        return None
    return paired.accuracy_difference([r for r, _ in common], [v for _, v in common])


def _bits_per_byte(metric: Metric, ref: VariantEvals, var: VariantEvals) -> paired.Paired | None:
    a, b = _items(ref, metric.source or ""), _items(var, metric.source or "")
    if not (a and b and a.loglikelihood and b.loglikelihood and a.bytes):
        return None
    by_id = dict(zip(b.ids, b.loglikelihood, strict=True))
    rows = [
        (ll, by_id[i], n)
        for i, ll, n in zip(a.ids, a.loglikelihood, a.bytes, strict=True)
        if i in by_id
    ]
    if not rows:
        return None
    ref_ll, var_ll, size = zip(*rows, strict=True)
    return paired.bits_per_byte_difference(ref_ll, var_ll, size)


def _windows(metric: Metric, reference: str, var: VariantEvals) -> paired.Paired | None:
    div = var.divergence
    stats = div.data.get(metric.source or "") if div and div.reference == reference else None
    if stats is None or stats.window_nll is None or stats.window_reference_nll is None:
        return None
    return paired.window_difference(stats.window_reference_nll, stats.window_nll)


def compare(
    metrics: list[Metric], measured: dict[str, VariantEvals], reference: str
) -> dict[str, Any]:
    """report.json's `comparisons`: every paired metric of every other variant against
    `reference`, adjusted together; `unpaired` lists (variant, metric) without per-item scores."""
    ref = measured[reference]
    rows: list[dict[str, Any]] = []
    unpaired: list[str] = []
    for name, var in measured.items():
        if name == reference:
            continue
        for m in metrics:
            if m.paired is None:
                continue
            if m.paired == "accuracy":
                result = _accuracy(m, ref, var)
            elif m.paired == "bits_per_byte":
                result = _bits_per_byte(m, ref, var)
            else:
                result = _windows(m, reference, var)
            if result is None:
                unpaired.append(f"{name}/{m.key}")
                continue
            rows.append(
                {"variant": name, "metric": m.key, "pairing": m.paired, "better": m.better}
                | ({"data": m.source} if m.paired == "window_nll" else {})
                | result.to_json()
            )
    for row, p in zip(rows, paired.adjust([r["p"] for r in rows]), strict=True):
        row["p_adjusted"] = p
        row["verdict"] = paired.verdict(row["delta"], p, row["better"])
    return {
        "reference": reference,
        "alpha": paired.ALPHA,
        "power": paired.POWER,
        "adjustment": f"Benjamini-Hochberg over {len(rows)} comparisons",
        "rows": rows,
        "unpaired": unpaired,
    }


def describe_delta(row: Comparison) -> str:
    """A difference and its interval in the metric's own terms: accuracy points, bits per byte,
    or the perplexity ratio as a percentage."""
    kind, d, lo, hi = row.pairing, row.delta, row.low, row.high
    if kind == "accuracy":
        return f"{100 * d:+.1f} pts [{100 * lo:+.1f}, {100 * hi:+.1f}]"
    if kind == "bits_per_byte":
        return f"{d:+.4f} bits/byte [{lo:+.4f}, {hi:+.4f}]"
    return f"{100 * math.expm1(d):+.2f}% ppl [{100 * math.expm1(lo):+.2f}, {100 * math.expm1(hi):+.2f}]"


def describe_mde(row: Comparison) -> str:
    kind, mde = row.pairing, row.mde
    if kind == "accuracy":
        return f"{100 * mde:.1f} pts"
    if kind == "bits_per_byte":
        return f"{mde:.4f} bits/byte"
    return f"{100 * math.expm1(mde):.2f}% ppl"


def summary(comparisons: dict[str, Any], variant: str) -> str:
    """A variant's verdicts in a few words: `2 worse, 1 better, 3 within noise`."""
    if variant == comparisons["reference"]:
        return "reference"
    verdicts = [r["verdict"] for r in comparisons["rows"] if r["variant"] == variant]
    if not verdicts:
        return "not paired"
    counts = {v: verdicts.count(v) for v in ("worse", "better", "no detectable difference")}
    return (
        f"{counts['worse']} worse, {counts['better']} better, "
        f"{counts['no detectable difference']} within noise"
    )

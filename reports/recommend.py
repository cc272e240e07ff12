"""The report's recommendation: plain sentences computed from report.json alone (a `Report`).

Model: the reader must pick one variant. The sentences say (1) the smallest variant whose
benchmark scores show no detectable loss against the reference at this n (and what this n could
have detected), (2) what each variant costs: its weights against the reference's and every paired
difference that is detectable, one measured on a data set the variant's own steps trained or
calibrated on marked as in-domain (a LoRA's gain on its training text is no evidence), (3) which
variants are dominated on weight memory against the quality axis (held-out KL), by whom, and
which variants were left off that axis because they trained or calibrated on its data, (4) with an SLO, the capacity within it, (5) for a variant
served differently from another with the same weights (an int8 KV cache), how far its KV cache
and saturation point moved. Nothing here is written by hand per run: change a number in
report.json and the sentence changes with it.
"""

from __future__ import annotations

from collections import defaultdict

from reports.comparisons import describe_delta, describe_mde
from reports.metrics import CAPACITY_RATE, KV_TOKENS, SATURATION, VARIANT, WEIGHT_BYTES
from reports.records import Comparison, Recommendation, Report, VariantRow
from reports.rows import front


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 10e6 else f"{n / 1e6:.2f} MB"


def _benchmark(row: Comparison) -> bool:
    return row.pairing in ("accuracy", "bits_per_byte")


FITTED = " (in-domain: held-out text of the data set it trained or calibrated on)"
"""After a held-out difference measured on a data set the variant's own steps used (another
split of it: the gain or loss there is not evidence about text the variant never saw)."""


def _named(row: Comparison, report: Report, seen: frozenset[str] = frozenset()) -> str:
    fitted = FITTED if row.data in seen else ""
    return f"{report.label(row.metric)} {describe_delta(row)}{fitted}"


class _Run:
    def __init__(self, report: Report) -> None:
        self.report = report
        self.reference: str | None = report.comparisons.reference
        self.rows = report.variants
        self.weights = {v.name: v.weight_bytes for v in self.rows}
        self.by_variant: dict[str, list[Comparison]] = defaultdict(list)
        for row in report.comparisons.rows:
            self.by_variant[row.variant].append(row)
        self.axis = report.quality_axis
        self.front = report.pareto_front
        self.seen = {v.name: v.seen_data for v in self.rows}

    def ratio(self, name: str) -> str:
        w, ref = self.weights.get(name), self.weights.get(self.reference or "")
        return f"{w / ref:.2f}x {self.reference}'s weights" if w and ref else "weights unknown"

    def benchmarks(self, name: str) -> list[Comparison]:
        return [r for r in self.by_variant[name] if _benchmark(r)]


def _smallest_without_loss(run: _Run) -> str:
    ref_bytes = run.weights.get(run.reference or "")
    clean = [
        name
        for name, rows in run.by_variant.items()
        if (b := run.benchmarks(name))
        and all(r.verdict != "worse" for r in b)
        and (w := run.weights.get(name))
        and (ref_bytes is None or w < ref_bytes)
    ]
    if not clean:
        least = sorted(
            (n for n in run.by_variant if run.benchmarks(n)),
            key=lambda n: sum(r.verdict == "worse" for r in run.benchmarks(n)),
        )
        hint = f"; fewest detectable losses: {least[0]}" if least else ""
        return (
            f"No variant smaller than {run.reference} is free of a detectable benchmark loss{hint}."
        )
    best = min(clean, key=lambda n: run.weights[n] or 0)
    bench = run.benchmarks(best)
    widest = max(bench, key=lambda r: r.mde)
    held_out = [
        r
        for r in run.by_variant[best]
        if not _benchmark(r) and r.data not in run.seen.get(best, ())
    ]
    worse_held = [r for r in held_out if r.verdict == "worse"]
    text = (
        f"**{best}** is the smallest variant with no detectable loss on the benchmarks against "
        f"{run.reference} ({_mb(run.weights[best] or 0)}, {run.ratio(best)}); at this n a loss "
        f"smaller than {describe_mde(widest)} on {run.report.label(widest.metric)}"
        " would not have been detected."
    )
    if worse_held:
        costs = "; ".join(_named(r, run.report) for r in worse_held)
        text += f" Held-out text does show its cost: {costs}."
    return text


def _costs(run: _Run, name: str) -> str:
    rows = run.by_variant[name]
    worse = [r for r in rows if r.verdict == "worse"]
    better = [r for r in rows if r.verdict == "better"]
    same = [r for r in rows if r.verdict == "no detectable difference"]
    size = run.weights.get(name)
    parts = [f"**{name}** ({_mb(size) if size else '?'}, {run.ratio(name)}):"]
    seen = run.seen.get(name, frozenset())
    if worse:
        parts.append("Worse on " + "; ".join(_named(r, run.report, seen) for r in worse) + ".")
    if better:
        parts.append("Better on " + "; ".join(_named(r, run.report, seen) for r in better) + ".")
    if same:
        labels = ", ".join(run.report.label(r.metric) for r in same)
        parts.append(f"No detectable difference on {labels}.")
    return " ".join(parts)


def _dominated(run: _Run) -> list[str]:
    key, lower, excluded = run.axis.key, run.axis.lower_is_better, set(run.axis.excluded)
    if not key:
        return []
    usable = [
        v for v in run.rows
        if v.value(key) is not None and v.weight_bytes and v.name not in excluded
    ]  # fmt: skip
    out = []
    for r in usable:
        if r.name in run.front:
            continue
        by = next(
            (
                o.name
                for o in usable
                if o.name in run.front
                and o.value(WEIGHT_BYTES) <= r.value(WEIGHT_BYTES)
                and (o.value(key) <= r.value(key) if lower else o.value(key) >= r.value(key))
            ),
            "?",
        )
        out.append(f"{r.name} (by {by})")
    label = run.report.label(key)
    sentences = []
    if out:
        sentences.append(
            f"Dominated on weight memory against {label}: {', '.join(out)}: another variant is "
            "no larger and at least as close to the reference."
        )
    if excluded:
        sentences.append(
            f"Left off that comparison because they trained or calibrated on its data: "
            f"{', '.join(sorted(excluded))}."
        )
    return sentences


def _capacity(run: _Run) -> list[str]:
    """Per prompt length with an SLO: each variant's highest request rate within it, and the
    variants no other beats on both that rate and the quality axis."""
    key, lower, excluded = run.axis.key, run.axis.lower_is_better, set(run.axis.excluded)
    out = []
    for column in (c.key for c in run.report.columns if CAPACITY_RATE.owns(c.key)):
        label = run.report.label(column)
        rated = sorted((v for v in run.rows if v.value(column) is not None),
                       key=lambda v: -v.value(column))  # fmt: skip
        missed = [v.name for v in run.rows if v.value(column) is None]
        text = f"{label}: " + (
            ", ".join(f"{v.name} {v.value(column):.3g}" for v in rated) or "no variant met it"
        )
        if missed and rated:
            text += f"; none met it: {', '.join(missed)}"
        text += "."
        spread = _sittings_of(run, [v.name for v in rated])
        if spread > 1:
            text += f" (Measured in {spread} sittings: compare these rates only roughly.)"
        if key and rated:
            best = front([v.row | {VARIANT.key: v.name} for v in rated if v.name not in excluded],
                         [(column, False), (key, lower)])  # fmt: skip
            text += f" Not beaten on both capacity and {run.report.label(key)}: {', '.join(best)}."
        out.append(text)
    return out


def _sittings_of(run: _Run, names: list[str]) -> int:
    """How many of the report's load sittings the variants `names` were measured in."""
    return sum(bool(set(s["variants"]) & set(names)) for s in run.report.load_sittings)


def _saturation(variant: VariantRow) -> str:
    points = SATURATION.values(variant.row)
    return ", ".join(f"p{n} {c or 'not reached'}" for n, c in points.items()) or "not measured"


def _served_differently(run: _Run) -> list[str]:
    """For each variant served with non-default settings (`serve:`) whose weights another
    variant serves plainly: its KV tokens and saturation concurrency beside that twin's."""
    hashes = {v.name: v.manifest.get("hash") for v in run.rows}
    plain = {hashes[v.name]: v for v in run.rows if not v.serve}
    out = []
    for v in run.rows:
        twin = plain.get(hashes[v.name])
        if not v.serve or twin is None:
            continue
        settings = ", ".join(f"{k} {x}" for k, x in v.serve.items())
        tokens, twin_tokens = v.value(KV_TOKENS), twin.value(KV_TOKENS)
        moved = (
            f"KV tokens {twin_tokens:,.0f} -> {tokens:,.0f} ({tokens / twin_tokens:.2f}x) in the "
            "same budget"
            if tokens and twin_tokens
            else "KV tokens not measured"
        )
        out.append(
            f"{v.name} is {twin.name}'s weights served with {settings}: {moved}; KV "
            f"saturation concurrency {_saturation(twin)} -> {_saturation(v)}."
        )
    return out


def recommendation(report: Report) -> Recommendation:
    """The recommendation's sentences, in order."""
    run = _Run(report)
    if run.reference is None or not run.by_variant:
        return Recommendation(
            ["No variant was compared with a reference (one variant, or nothing measured)."]
        )
    comparisons = report.comparisons
    sentences = [
        f"Every difference below is paired against {run.reference} on the same documents or "
        f"windows, 95% intervals, called only at adjusted p < {comparisons.alpha} "
        f"({comparisons.adjustment}).",
        _smallest_without_loss(run),
    ]
    sentences += [_costs(run, name) for name in run.by_variant]
    return Recommendation(sentences + _dominated(run) + _capacity(run) + _served_differently(run))

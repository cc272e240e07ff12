"""The report's recommendation: plain sentences computed from report.json alone.

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
from typing import Any

from reports.comparisons import describe_delta, describe_mde
from reports.metrics import CAPACITY_RATE, SATURATION
from reports.rows import front


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 10e6 else f"{n / 1e6:.2f} MB"


def _benchmark(row: dict[str, Any]) -> bool:
    return row["pairing"] in ("accuracy", "bits_per_byte")


FITTED = " (in-domain: held-out text of the data set it trained or calibrated on)"
"""After a held-out difference measured on a data set the variant's own steps used (another
split of it: the gain or loss there is not evidence about text the variant never saw)."""


def _named(row: dict[str, Any], labels: dict[str, str], seen: frozenset[str] = frozenset()) -> str:
    fitted = FITTED if row.get("data") in seen else ""
    return f"{labels.get(row['metric'], row['metric'])} {describe_delta(row)}{fitted}"


class _Run:
    def __init__(self, report: dict[str, Any]) -> None:
        comparisons = report.get("comparisons") or {}
        self.reference: str | None = comparisons.get("reference")
        self.rows = [v["row"] for v in report["variants"]]
        self.weights = {r["variant"]: r.get("weight_bytes") for r in self.rows}
        self.labels = {c["key"]: c["label"] for c in report["columns"]}
        self.by_variant: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in comparisons.get("rows", []):
            self.by_variant[row["variant"]].append(row)
        self.axis = report.get("quality_axis") or {}
        self.front = report.get("pareto_front") or []
        self.variants: list[dict[str, Any]] = report["variants"]
        self.sittings: list[dict[str, Any]] = report.get("load_sittings") or []
        self.seen = {v["name"]: frozenset(v.get("seen_data") or ()) for v in self.variants}

    def ratio(self, name: str) -> str:
        w, ref = self.weights.get(name), self.weights.get(self.reference or "")
        return f"{w / ref:.2f}x {self.reference}'s weights" if w and ref else "weights unknown"

    def benchmarks(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.by_variant[name] if _benchmark(r)]


def _smallest_without_loss(run: _Run) -> str:
    ref_bytes = run.weights.get(run.reference or "")
    clean = [
        name
        for name, rows in run.by_variant.items()
        if (b := run.benchmarks(name))
        and all(r["verdict"] != "worse" for r in b)
        and (w := run.weights.get(name))
        and (ref_bytes is None or w < ref_bytes)
    ]
    if not clean:
        least = sorted(
            (n for n in run.by_variant if run.benchmarks(n)),
            key=lambda n: sum(r["verdict"] == "worse" for r in run.benchmarks(n)),
        )
        hint = f"; fewest detectable losses: {least[0]}" if least else ""
        return (
            f"No variant smaller than {run.reference} is free of a detectable benchmark loss{hint}."
        )
    best = min(clean, key=lambda n: run.weights[n] or 0)
    bench = run.benchmarks(best)
    widest = max(bench, key=lambda r: r["mde"])
    held_out = [
        r
        for r in run.by_variant[best]
        if not _benchmark(r) and r.get("data") not in run.seen.get(best, ())
    ]
    worse_held = [r for r in held_out if r["verdict"] == "worse"]
    text = (
        f"**{best}** is the smallest variant with no detectable loss on the benchmarks against "
        f"{run.reference} ({_mb(run.weights[best] or 0)}, {run.ratio(best)}); at this n a loss "
        f"smaller than {describe_mde(widest)} on {run.labels.get(widest['metric'], widest['metric'])}"
        " would not have been detected."
    )
    if worse_held:
        costs = "; ".join(_named(r, run.labels) for r in worse_held)
        text += f" Held-out text does show its cost: {costs}."
    return text


def _costs(run: _Run, name: str) -> str:
    rows = run.by_variant[name]
    worse = [r for r in rows if r["verdict"] == "worse"]
    better = [r for r in rows if r["verdict"] == "better"]
    same = [r for r in rows if r["verdict"] == "no detectable difference"]
    size = run.weights.get(name)
    parts = [f"**{name}** ({_mb(size) if size else '?'}, {run.ratio(name)}):"]
    seen = run.seen.get(name, frozenset())
    if worse:
        parts.append("Worse on " + "; ".join(_named(r, run.labels, seen) for r in worse) + ".")
    if better:
        parts.append("Better on " + "; ".join(_named(r, run.labels, seen) for r in better) + ".")
    if same:
        labels = ", ".join(run.labels.get(r["metric"], r["metric"]) for r in same)
        parts.append(f"No detectable difference on {labels}.")
    return " ".join(parts)


def _dominated(run: _Run) -> list[str]:
    key, lower = run.axis.get("key"), run.axis.get("lower_is_better", True)
    excluded = set(run.axis.get("excluded", []))
    if not key:
        return []
    usable = [
        r for r in run.rows
        if r.get(key) is not None and r.get("weight_bytes") and r["variant"] not in excluded
    ]  # fmt: skip
    out = []
    for r in usable:
        if r["variant"] in run.front:
            continue
        by = next(
            (
                o["variant"]
                for o in usable
                if o["variant"] in run.front
                and o["weight_bytes"] <= r["weight_bytes"]
                and (o[key] <= r[key] if lower else o[key] >= r[key])
            ),
            "?",
        )
        out.append(f"{r['variant']} (by {by})")
    label = run.labels.get(key, key)
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
    key, lower = run.axis.get("key"), run.axis.get("lower_is_better", True)
    excluded = set(run.axis.get("excluded", []))
    out = []
    for column in (k for k in run.labels if CAPACITY_RATE.owns(k)):
        label = run.labels[column]
        rated = sorted((r for r in run.rows if r.get(column) is not None), key=lambda r: -r[column])
        missed = [r["variant"] for r in run.rows if r.get(column) is None]
        text = f"{label}: " + (
            ", ".join(f"{r['variant']} {r[column]:.3g}" for r in rated) or "no variant met it"
        )
        if missed and rated:
            text += f"; none met it: {', '.join(missed)}"
        text += "."
        spread = _sittings_of(run, [r["variant"] for r in rated])
        if spread > 1:
            text += f" (Measured in {spread} sittings: compare these rates only roughly.)"
        if key and rated:
            best = front([r for r in rated if r["variant"] not in excluded],
                         [(column, False), (key, lower)])  # fmt: skip
            text += (
                f" Not beaten on both capacity and {run.labels.get(key, key)}: {', '.join(best)}."
            )
        out.append(text)
    return out


def _sittings_of(run: _Run, names: list[str]) -> int:
    """How many of the report's load sittings the variants `names` were measured in."""
    return sum(bool(set(s["variants"]) & set(names)) for s in run.sittings)


def _saturation(row: dict[str, Any]) -> str:
    points = SATURATION.values(row)
    return ", ".join(f"p{n} {c or 'not reached'}" for n, c in points.items()) or "not measured"


def _served_differently(run: _Run) -> list[str]:
    """For each variant served with non-default settings (`serve:`) whose weights another
    variant serves plainly: its KV tokens and saturation concurrency beside that twin's."""
    hashes = {v["name"]: v.get("manifest", {}).get("hash") for v in run.variants}
    plain = {hashes[v["name"]]: v["row"] for v in run.variants if not v.get("serve")}
    out = []
    for v in run.variants:
        twin = plain.get(hashes[v["name"]])
        if not v.get("serve") or twin is None:
            continue
        row, settings = v["row"], ", ".join(f"{k} {x}" for k, x in v["serve"].items())
        tokens, twin_tokens = row.get("kv_tokens"), twin.get("kv_tokens")
        moved = (
            f"KV tokens {twin_tokens:,.0f} -> {tokens:,.0f} ({tokens / twin_tokens:.2f}x) in the "
            "same budget"
            if tokens and twin_tokens
            else "KV tokens not measured"
        )
        out.append(
            f"{v['name']} is {twin['variant']}'s weights served with {settings}: {moved}; KV "
            f"saturation concurrency {_saturation(twin)} -> {_saturation(row)}."
        )
    return out


def recommendation(report: dict[str, Any]) -> list[str]:
    """The recommendation's sentences, in order."""
    run = _Run(report)
    if run.reference is None or not run.by_variant:
        return ["No variant was compared with a reference (one variant, or nothing measured)."]
    comparisons = report["comparisons"]
    sentences = [
        f"Every difference below is paired against {run.reference} on the same documents or "
        f"windows, 95% intervals, called only at adjusted p < {comparisons['alpha']} "
        f"({comparisons['adjustment']}).",
        _smallest_without_loss(run),
    ]
    sentences += [_costs(run, name) for name in run.by_variant]
    return sentences + _dominated(run) + _capacity(run) + _served_differently(run)

"""The recommendation is computed from report.json: edit a number or a verdict there and the
sentence changes with it."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from reports import recommend
from reports.recommend import FITTED
from reports.records import Report
from reports.report import seen_data
from reports.rows import pareto_front

SIZES = {"base": 1000e6, "int8": 500e6, "nf4": 300e6, "int4": 250e6}
KL = {"base": 0.0, "int8": 0.01, "nf4": 0.5, "int4": 0.4}


def recommendation(report: dict[str, Any]) -> list[str]:
    """The sentences of the recommendation of `report` (report.json's shape)."""
    return recommend.recommendation(Report.from_json(report)).sentences


def _comparison(variant: str, metric: str, pairing: str, delta: float, verdict: str) -> dict:
    return {
        "variant": variant, "metric": metric, "pairing": pairing, "better": "higher"
        if pairing == "accuracy" else "lower", "n": 200, "delta": delta, "low": delta - 0.03,
        "high": delta + 0.03, "p": 0.5, "p_adjusted": 0.5, "mde": 0.07, "test": "t",
        "verdict": verdict,
    } | ({"data": metric.removeprefix("ppl_")} if pairing == "window_nll" else {})  # fmt: skip


def make_report(**verdicts: str) -> dict[str, Any]:
    rows = [
        {"variant": n, "weight_bytes": SIZES[n], "kl_corpus": KL[n], "hellaswag": 0.4}
        for n in SIZES
    ]
    comparisons = []
    for n in SIZES:
        if n != "base":
            verdict = verdicts.get(n, "no detectable difference")
            comparisons.append(_comparison(n, "hellaswag", "accuracy", -0.01, verdict))
            comparisons.append(_comparison(n, "ppl_corpus", "window_nll", 0.012, "worse"))
    report = {
        "columns": [
            {"key": "variant", "label": "variant", "format": "text", "group": "variant"},
            {"key": "weight_bytes", "label": "weight memory", "format": "bytes"},
            {"key": "hellaswag", "label": "hellaswag (acc_norm, n=200)", "format": "pct"},
            {"key": "ppl_corpus", "label": "token ppl (corpus)", "format": "float"},
            {"key": "kl_corpus", "label": "KL vs base (corpus, nats)", "format": "float"},
        ],
        "variants": [{"name": r["variant"], "row": r} for r in rows],
        "comparisons": {
            "reference": "base",
            "alpha": 0.05,
            "rows": comparisons,
            "adjustment": "Benjamini-Hochberg over 6 comparisons",
        },
        "quality_axis": {"key": "kl_corpus", "lower_is_better": True, "excluded": []},
    }
    report["pareto_front"] = pareto_front(rows, "kl_corpus", True)
    return report


def test_the_smallest_variant_without_a_detectable_loss_follows_the_verdicts() -> None:
    text = recommendation(make_report())
    assert text[1].startswith("**int4** is the smallest variant with no detectable loss")
    assert "(250 MB, 0.25x base's weights)" in text[1]
    small = make_report()
    small["variants"][3]["row"]["weight_bytes"] = 2.5e6
    assert "(2.50 MB, 0.00x base's weights)" in recommendation(small)[1]
    assert "smaller than 7.0 pts on hellaswag (acc_norm, n=200)" in text[1]
    assert "Held-out text does show its cost: token ppl (corpus) +1.21% ppl" in text[1]
    assert recommendation(make_report(int4="worse"))[1].startswith("**nf4** is the smallest")
    both = recommendation(make_report(int4="worse", nf4="worse"))
    assert both[1].startswith("**int8** is the smallest")
    none = recommendation(make_report(int4="worse", nf4="worse", int8="worse"))
    assert none[1].startswith("No variant smaller than base is free of a detectable")


def test_each_variants_costs_are_its_detectable_differences() -> None:
    text = recommendation(make_report(nf4="worse"))
    nf4 = next(s for s in text if s.startswith("**nf4**"))
    assert nf4.startswith("**nf4** (300 MB, 0.30x base's weights): Worse on ")
    assert "hellaswag (acc_norm, n=200) -1.0 pts [-4.0, +2.0]" in nf4
    report = make_report(nf4="worse")
    row = next(r for r in report["comparisons"]["rows"] if r["variant"] == "nf4")
    row |= {"delta": -0.05, "low": -0.09, "high": -0.01}
    edited = next(s for s in recommendation(report) if s.startswith("**nf4**"))
    assert "hellaswag (acc_norm, n=200) -5.0 pts [-9.0, -1.0]" in edited
    int8 = next(s for s in text if s.startswith("**int8**"))
    assert "No detectable difference on hellaswag (acc_norm, n=200)." in int8
    assert f"+{100 * math.expm1(0.012):.2f}% ppl" in int8


def test_dominated_variants_name_who_dominates_them() -> None:
    report = make_report()
    assert report["pareto_front"] == ["base", "int8", "int4"]
    text = recommendation(report)
    assert any("Dominated on weight memory against KL vs base (corpus, nats): nf4 (by int4)" in s
               for s in text)  # fmt: skip
    cheaper = copy.deepcopy(report)
    cheaper["variants"][2]["row"]["kl_corpus"] = 0.3  # nf4 now closer than int4
    cheaper["pareto_front"] = pareto_front(
        [v["row"] for v in cheaper["variants"]], "kl_corpus", True
    )
    assert not any(s.startswith("Dominated") for s in recommendation(cheaper))


def test_variants_trained_on_the_axis_data_are_named_and_left_off() -> None:
    report = make_report()
    report["quality_axis"]["excluded"] = ["nf4"]
    report["pareto_front"] = pareto_front(
        [v["row"] for v in report["variants"] if v["name"] != "nf4"], "kl_corpus", True
    )
    text = recommendation(report)
    assert (
        text[-1] == "Left off that comparison because they trained or calibrated on its data: nf4."
    )
    assert not any(s.startswith("Dominated") for s in text)


def test_seen_data_finds_training_replay_and_calibration_data() -> None:
    from compress.manifest import StepRecord

    steps = [
        StepRecord(
            name="quantize", params={"calibration": {"data": "corpus", "samples": 64}}, hash="a"
        ),
        StepRecord(name="lora", params={"data": "shakespeare", "replay_data": "shift"}, hash="b"),
    ]
    assert seen_data(steps) == {"corpus", "shakespeare", "shift"}
    assert seen_data([StepRecord(name="identity", params={}, hash="c")]) == set()


@pytest.mark.parametrize("missing", ["comparisons", "rows"])
def test_nothing_compared_says_so(missing: str) -> None:
    report = make_report()
    if missing == "comparisons":
        report["comparisons"] = None
    else:
        report["comparisons"]["rows"] = []
    assert recommendation(report) == [
        "No variant was compared with a reference (one variant, or nothing measured)."
    ]


def test_failed_requests_and_a_disagreeing_server_check_are_problems() -> None:
    from reports.report import problems

    report = make_report()
    ok_point = {"failed": 0, "requests": 8, "concurrency": 4, "prompt_len": 16}
    for v in report["variants"]:
        v["load"] = {"points": [ok_point], "rate_points": None, "capacity": None}
    assert problems(report) == []
    report["variants"][1]["load"]["points"] = [ok_point | {"failed": 3, "requests": 5}]
    rate = ok_point | {"failed": 1, "requests": 7, "request_rate": 2.5}
    report["variants"][2]["load"]["capacity"] = {"16": {"searched": [rate]}}
    report["server_check"] = {"ok": False, "variant": "base"}
    assert problems(report) == [
        "int8: 3 of 8 requests failed at concurrency 4, prompt 16",
        "nf4: 1 of 8 requests failed at 2.5 req/s, prompt 16",
        "server check on base: lm-eval through the server disagrees",
    ]


def test_capacity_within_the_slo_is_ranked_and_traded_against_quality() -> None:
    report = make_report()
    label = "req/s within SLO p128 (ttft_p95 2 s)"
    report["columns"].append({"key": "capacity_rate_p128", "label": label, "format": "float"})
    rates = {"base": 2.0, "int8": 3.0, "nf4": 5.0, "int4": None}
    for v in report["variants"]:
        v["row"]["capacity_rate_p128"] = rates[v["name"]]
    text = [s for s in recommendation(report) if s.startswith(label)]
    assert text == [
        f"{label}: nf4 5, int8 3, base 2; none met it: int4. Not beaten on both capacity and "
        "KL vs base (corpus, nats): nf4, int8, base."
    ]
    report["variants"][2]["row"]["capacity_rate_p128"] = 2.5  # nf4: slower than int8 now
    text = [s for s in recommendation(report) if s.startswith(label)]
    assert text[0].endswith("KL vs base (corpus, nats): int8, base.")


def test_a_variant_served_differently_is_set_beside_its_twin() -> None:
    """A `serve:` variant with another's weights (same manifest hash) gets one sentence: its KV
    tokens and saturation beside the twin's, read from the rows; one without a plain twin, none."""
    report = make_report()
    for v in report["variants"]:
        v["manifest"] = {"hash": v["name"]}
    kv8 = {"variant": "int8-kv8", "weight_bytes": SIZES["int8"], "kl_corpus": 0.012}
    kv8 |= {"kv_tokens": 4000, "saturation_p64": 64, "saturation_p256": None}
    int8 = report["variants"][1]["row"]
    int8 |= {"kv_tokens": 1000, "saturation_p64": 16, "saturation_p256": 4}
    report["variants"].append(
        {"name": "int8-kv8", "row": kv8, "serve": {"kv_cache_dtype": "int8"},
         "manifest": {"hash": "int8"}}
    )  # fmt: skip
    served = [s for s in recommendation(report) if s.startswith("int8-kv8 is")]
    assert served == [
        "int8-kv8 is int8's weights served with kv_cache_dtype int8: KV tokens 1,000 -> 4,000 "
        "(4.00x) in the same budget; KV saturation concurrency p64 16, p256 4 -> p64 64, p256 "
        "not reached."
    ]
    report["variants"][-1]["manifest"]["hash"] = "own weights"
    assert not [s for s in recommendation(report) if s.startswith("int8-kv8 is")]


def test_a_difference_on_data_the_variant_fitted_is_marked_as_such() -> None:
    report = make_report()
    text = recommendation(report)
    int8 = next(s for s in text if s.startswith("**int8**"))
    assert "token ppl (corpus) +1.21% ppl" in int8 and FITTED not in int8
    assert "Held-out text does show its cost: token ppl (corpus)" in text[1]
    for v in report["variants"]:
        v["seen_data"] = ["corpus"] if v["name"] in ("int8", "int4") else ["shakespeare"]
    text = recommendation(report)
    int8 = next(s for s in text if s.startswith("**int8**"))
    assert f"token ppl (corpus) +1.21% ppl [-1.78, +4.29]{FITTED}" in int8
    nf4 = next(s for s in text if s.startswith("**nf4**"))
    assert FITTED not in nf4  # it fitted Shakespeare, not the corpus
    assert text[1].startswith("**int4** is the smallest") and "Held-out text" not in text[1]

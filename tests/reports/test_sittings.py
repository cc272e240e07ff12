"""Load results are grouped into sittings (one machine, no long pause), and a report whose
serving figures come from more than one says so."""

from __future__ import annotations

from typing import Any

from reports.sittings import load_sittings, sitting_lines
from tests.reports.test_recommend import make_report, recommendation

MACHINE = {"host": "vm-1", "cpu": "AMD EPYC 7B13", "cpu_count": 2}


def _measured(started: str, seconds: float, **machine: Any) -> dict[str, Any]:
    return {"started": started, "seconds": seconds, **(MACHINE | machine)}


def _report(measured: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    variants = []
    for name, m in measured.items():
        load = {"points": []} | ({"measured": m} if m else {})
        variants.append({"name": name, "load": load})
    return {"variants": [*variants, {"name": "no-load", "load": None}]}


def test_ramps_run_back_to_back_on_one_machine_are_one_sitting() -> None:
    report = _report(
        {
            "base": _measured("2026-12-02T19:00:00+00:00", 300),
            "int8": _measured("2026-12-02T19:06:00+00:00", 240),  # 1 min after base ended
            "nf4": _measured("2026-12-02T19:29:00+00:00", 60),  # 19 min after int8 ended
        }
    )
    assert load_sittings(report) == [
        {
            "variants": ["base", "int8", "nf4"],
            "started": "2026-12-02T19:00:00+00:00",
            "ended": "2026-12-02T19:30:00+00:00",
            **MACHINE,
        }
    ]
    report["load_sittings"] = load_sittings(report)
    assert sitting_lines(report) == []


def test_a_long_pause_another_machine_or_an_unknown_time_starts_another_sitting() -> None:
    report = _report(
        {
            "int8": _measured("2026-12-02T19:31:00+00:00", 60),  # 21 min after base ended
            "base": _measured("2026-12-02T19:00:00+00:00", 600),
            "nf4": _measured("2026-12-02T19:33:00+00:00", 60, host="vm-2"),
            "old": None,
        }
    )
    sittings = load_sittings(report)
    assert [(s["variants"], s["started"]) for s in sittings] == [
        (["base"], "2026-12-02T19:00:00+00:00"),
        (["int8"], "2026-12-02T19:31:00+00:00"),
        (["nf4"], "2026-12-02T19:33:00+00:00"),
        (["old"], None),
    ]
    report["load_sittings"] = sittings
    lines = sitting_lines(report)
    assert lines[0].startswith("Load results from 4 sittings: compare throughput and latency")
    assert lines[1] == "base: 2026-12-02 19:00 to 19:10 UTC on vm-1 (AMD EPYC 7B13, 2 CPUs)"
    assert lines[3].startswith("nf4: 2026-12-02 19:33 to 19:34 UTC on vm-2")
    assert lines[4] == "old: measured at an unknown time (stored by an older workbench)"


def test_the_capacity_sentence_says_when_sittings_are_mixed() -> None:
    report = make_report()
    label = "req/s within SLO p128 (ttft_p95 2 s)"
    report["columns"].append({"key": "capacity_rate_p128", "label": label, "format": "float"})
    for v in report["variants"]:
        v["row"]["capacity_rate_p128"] = 2.0
    report["load_sittings"] = [
        {"variants": ["base", "int8"], "started": "2026-12-01T10:00:00+00:00"},
        {"variants": ["nf4"], "started": "2026-12-02T10:00:00+00:00"},
    ]
    sentence = next(s for s in recommendation(report) if s.startswith(label))
    assert "(Measured in 2 sittings: compare these rates only roughly.)" in sentence
    report["load_sittings"] = report["load_sittings"][:1]
    sentence = next(s for s in recommendation(report) if s.startswith(label))
    assert "sittings" not in sentence


def test_each_ramp_names_the_machine_and_gpu_or_cpu_it_ran_on() -> None:
    from evals.results import LoadResult, Sitting
    from reports.rows import ran_on

    sitting = Sitting(started="2026-12-02T19:00:00+00:00", seconds=60.0, **MACHINE)
    on_cpu = LoadResult.model_construct(measured=sitting, gpu=None, measured_on=None)
    assert ran_on(on_cpu) == "vm-1 (AMD EPYC 7B13, 2 CPUs)"
    gpu = "NVIDIA H100 80GB HBM3"
    on_gpu = LoadResult.model_construct(measured=sitting, gpu=gpu, measured_on=None)
    assert ran_on(on_gpu) == "vm-1 (NVIDIA H100 80GB HBM3)"
    twin = LoadResult.model_construct(measured=sitting, gpu=gpu, measured_on="int8")
    assert ran_on(twin) == "as int8 on vm-1 (NVIDIA H100 80GB HBM3)"
    older = LoadResult.model_construct(measured=None, gpu=None, measured_on=None)
    assert ran_on(older) is None

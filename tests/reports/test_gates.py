"""Quality gates: a recipe's `gates:` judged on the report's rows, shown as the report's problems
and decided into `workbench run`'s exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reports.gates import GATE_FAILED, check, exit_code

RECIPE = """\
name: gated
base: demo-tiny
device: cpu
variants:
  - {{name: base, steps: []}}
  - {{name: int8, steps: [{{quantize: {{method: bnb-int8}}}}]}}
evals:
  quality: [{{task: corpus_ppl, limit: 4}}]
  max_length: 32
gates: {{recovery: {{corpus_ppl: {threshold}}}}}
"""
"""The cheapest recipe with a gate the test controls: int8's recovery on corpus_ppl is near
100%, so a threshold of 2 (200%) fails and 0.5 passes."""


def _run(root: Path, threshold: float) -> tuple[int, str, dict]:
    (root / "recipe.yaml").write_text(RECIPE.format(threshold=threshold))
    proc = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "run", "recipe.yaml"],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=900,
    )
    report = json.loads((root / "reports/gated/report.json").read_text())
    return proc.returncode, proc.stdout + proc.stderr, report


@pytest.mark.e2e  # the CLI in a subprocess, building and measuring two variants
def test_a_failing_gate_exits_with_its_code_and_a_passing_one_with_0(tmp_path: Path) -> None:
    code, output, report = _run(tmp_path, 2.0)
    recovery = next(
        v["row"]["recovery_corpus_ppl"] for v in report["variants"] if v["name"] == "int8"
    )
    measured = recovery / 100
    assert code == GATE_FAILED == 3, output[-3000:]
    assert report["gates"] == [
        {"variant": "int8", "gate": "recovery.corpus_ppl", "bound": "at least",
         "threshold": 2.0, "measured": measured, "passed": False}
    ]  # fmt: skip
    problem = f"int8: gate recovery.corpus_ppl (at least 2) failed: measured {measured:.4g}"
    assert report["problems"] == [problem]
    assert f"problem: {problem}" in " ".join(output.split())
    page = (tmp_path / "reports/gated/index.html").read_text()
    assert "<section id='problems'>" in page and problem in page
    assert f"- {problem}" in (tmp_path / "reports/gated/report.md").read_text()

    code, output, report = _run(tmp_path, 0.5)  # the same builds and measurements, reused
    assert code == 0, output[-3000:]
    assert [g["passed"] for g in report["gates"]] == [True] and report["problems"] == []
    assert "<section id='problems'>" not in (tmp_path / "reports/gated/index.html").read_text()


def test_each_gate_kind_bounds_its_metric_and_an_unmeasured_figure_fails() -> None:
    rows = [
        {"variant": "base", "kl_corpus": 0.0, "agree_corpus": 1.0, "recovery_hellaswag": 100.0},
        {"variant": "int8", "kl_corpus": 0.02, "agree_corpus": 0.97, "recovery_hellaswag": 96.0},
        {"variant": "int4", "kl_corpus": 0.2, "agree_corpus": 0.8, "recovery_hellaswag": None},
    ]
    gates = {
        "max_kl": {"corpus": 0.05},
        "min_top1_agreement": {"corpus": 0.9},
        "recovery": {"hellaswag": 0.95},
    }
    results = check(gates, rows, reference="base")
    assert [(g.variant, g.gate, g.measured, g.passed) for g in results] == [
        ("int8", "max_kl.corpus", 0.02, True),
        ("int4", "max_kl.corpus", 0.2, False),
        ("int8", "min_top1_agreement.corpus", 0.97, True),
        ("int4", "min_top1_agreement.corpus", 0.8, False),
        ("int8", "recovery.hellaswag", 0.96, True),
        ("int4", "recovery.hellaswag", None, False),
    ]
    assert results[-1].problem() == (
        "int4: gate recovery.hellaswag (at least 0.95) failed: not measured"
    )
    failed = [g.problem() for g in results if not g.passed]
    assert exit_code(failed, results) == GATE_FAILED
    assert exit_code(["int8: 3 of 8 requests failed at concurrency 4", *failed], results) == 1
    assert exit_code([], [g for g in results if g.passed]) == 0

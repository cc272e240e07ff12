"""A recipe with `chat_prompts` and no `load:` still gets every variant's chat answers (before
the fix its servers never started and the report had none, silently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reports.conftest import greedy_chat_answer
from workbench import run

RECIPE = """\
name: chat-only
base: demo-tiny
variants:
  - {name: base, steps: []}
  - name: shop-lora
    steps: [{lora: {rank: 4, targets: [q_proj, v_proj], data: shift, steps: 4, lr: 0.003}}]
evals:
  chat_prompts: ["hi", "Return the"]
  chat_max_tokens: 6
  server_check_docs: 0
"""

pytestmark = pytest.mark.e2e  # servers in subprocesses


def test_chat_prompts_without_a_load_eval_are_answered(tmp_path: Path) -> None:
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    work = tmp_path / "runs" / "chat-only"
    run(tmp_path / "recipe.yaml", work, report_dir=tmp_path / "report")
    report = json.loads((tmp_path / "report" / "report.json").read_text())

    answers = report["answers"]
    assert sorted(answers) == ["base", "shop-lora"]
    for name in answers:
        assert [a["prompt"] for a in answers[name]] == ["hi", "Return the"]
        assert all(a["completion_tokens"] > 0 for a in answers[name])
    assert answers["base"][0]["answer"] == greedy_chat_answer("hi", 6)
    # nothing was ramped: no load eval was asked for
    assert not list(work.glob("evals/*/load.json"))
    assert all(v.get("load") is None for v in report["variants"])

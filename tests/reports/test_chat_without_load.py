"""A recipe with `chat_prompts` and no `load:` still gets every variant's chat answers (before
the fix its servers never started and the report had none, silently)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from catalog import ensure_demo_model
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


def _greedy_chat_answer(prompt: str, max_tokens: int) -> str:
    path = ensure_demo_model("demo-tiny")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    ids: Any = tok.apply_chat_template(  # return_dict: a mapping of tensors
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)
    return str(tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))


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
    assert answers["base"][0]["answer"] == _greedy_chat_answer("hi", 6)
    # nothing was ramped: no load eval was asked for
    assert not list(work.glob("evals/*/load.json"))
    assert all(v.get("load") is None for v in report["variants"])

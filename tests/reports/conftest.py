"""A real run of tests/reports/small.yaml (`workbench.run`, the CLI's own call), shared by the
report and dashboard tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from catalog import ensure_demo_model
from workbench import RunResult, run

RECIPE = Path(__file__).with_name("small.yaml")


@dataclass(frozen=True)
class Run:
    root: Path
    """The working directory: recipe.yaml, runs/small/, reports/small/."""
    result: RunResult

    @property
    def report_dir(self) -> Path:
        return self.root / "reports" / "small"


def run_in(root: Path, **kwargs: Any) -> RunResult:
    """`workbench run recipe.yaml` in `root`, in this process."""
    return run(
        root / "recipe.yaml",
        root / "runs" / "small",
        report_dir=root / "reports" / "small",
        **kwargs,
    )


def workbench_run(root: Path, *flags: str) -> str:
    """`workbench run recipe.yaml` in `root`; its combined output (fails the test on error)."""
    proc = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "run", "recipe.yaml", *flags],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("small-run")
    shutil.copy(RECIPE, root / "recipe.yaml")
    return Run(root, run_in(root))


def greedy_chat_answer(prompt: str, max_tokens: int) -> str:
    """What the tiny demo model answers `prompt` greedily through `generate` on its chat
    template: the answer a server must give."""
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

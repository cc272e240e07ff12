"""A recipe under `torchrun` (what `accelerate launch` runs): two CPU processes (gloo) train
together and write each variant once, with the same weights as one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from workbench.cli import main

RECIPE = """\
name: ddp
base: demo-tiny
variants:
  - {name: kd, steps: [{distill: {layers: 1, steps: 8, batch_size: 4, seq_len: 64, eval_every: 4, checkpoint_every: 4}}]}
  - {name: lora, steps: [{lora: {rank: 4, steps: 8, batch_size: 4, seq_len: 64}}]}
"""


@pytest.mark.e2e
def test_two_processes_train_like_one(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the report goes to ./reports/ddp: not into the checkout
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE)
    assert main(["run", str(recipe), "--work-dir", str(tmp_path / "one")]) == 0
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [
            str(torchrun),
            "--nproc_per_node",
            "2",
            "-m",
            "workbench.cli",
            "run",
            str(recipe),
            "--work-dir",
            str(tmp_path / "two"),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("built 2 variant(s)") == 1, "only the main process reports"
    for variant, weights in (("kd", "model.safetensors"), ("lora", "adapter_model.safetensors")):
        one = load_file(tmp_path / "one" / "variants" / variant / weights)
        two = load_file(tmp_path / "two" / "variants" / variant / weights)
        assert one.keys() == two.keys()
        for key in one:
            torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)
    leftovers = [p.name for p in (tmp_path / "two" / "variants").iterdir()]
    assert sorted(leftovers) == ["kd", "lora"]

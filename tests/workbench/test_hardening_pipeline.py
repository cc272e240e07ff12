"""Regression tests for artifacts and recipes that used to fool the pipeline (issue 11, items
16-19): corrupted variants are rebuilt, a re-saved local base invalidates its variants, LoRA on
int8-wo is refused before anything runs, and old training checkpoints are pruned."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from compress import content_hash
from compress.artifact import MANIFEST, file_sha256
from compress.training import TrainConfig, train
from serve.core.config import ModelConfig
from serve.engine.llm_engine import LLMEngine
from serve.lora.adapter import AdapterError
from serve.lora.registry import LoraConfig
from workbench.cli import main
from workbench.pipeline import Pipeline, PipelineError
from workbench.recipe import load_recipe

RECIPE = """\
name: tiny
base: {base}
variants:
  - {{name: base, steps: []}}
  - {{name: lora, steps: [{{lora: {{rank: 2, targets: [q_proj], steps: 2, batch_size: 2, seq_len: 16}}}}]}}
"""


def run(tmp_path: Path, base: str = "demo-tiny") -> dict[str, tuple[str, str | None]]:
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.format(base=base))
    recipe, ref = load_recipe(path)
    results = Pipeline(recipe, ref, tmp_path / "work").run()
    return {r.name: (r.status, r.rebuilt_because) for r in results}


def flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-10] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.fixture
def built(tmp_path: Path) -> Path:
    assert {k: s for k, (s, _) in run(tmp_path).items()} == {"base": "built", "lora": "built"}
    return tmp_path / "work" / "variants"


def test_manifest_records_the_content_hash_of_every_file(built: Path) -> None:
    for variant in ("base", "lora"):
        manifest = json.loads((built / variant / MANIFEST).read_text())
        files = {p.name for p in (built / variant).iterdir() if p.name != MANIFEST}
        assert set(manifest["files"]) == files
        for name, digest in manifest["files"].items():
            assert file_sha256(built / variant / name) == digest


@pytest.mark.parametrize(
    ("variant", "damage", "words"),
    [
        ("base", lambda d: flip_a_byte(d / "model.safetensors"), "model.safetensors changed"),
        ("base", lambda d: (d / "model.safetensors").unlink(), "model.safetensors is missing"),
        (
            "lora",
            lambda d: (d / "adapter_model.safetensors").write_bytes(
                (d / "adapter_model.safetensors").read_bytes()[:100]
            ),
            "adapter_model.safetensors changed",
        ),
    ],
    ids=["flipped-bytes", "deleted-weights", "truncated-adapter"],
)
def test_corrupted_variant_is_rebuilt_not_reused(
    built: Path, tmp_path: Path, variant: str, damage: object, words: str
) -> None:
    damage(built / variant)  # type: ignore[operator]
    status, because = run(tmp_path)[variant]
    assert status == "built" and because is not None and words in because
    manifest = json.loads((built / variant / MANIFEST).read_text())
    for name, digest in manifest["files"].items():
        assert file_sha256(built / variant / name) == digest
    assert run(tmp_path)[variant] == ("reused", None)


def test_serving_a_corrupted_variant_is_a_clear_error(
    built: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flip_a_byte(built / "base" / "model.safetensors")
    with pytest.raises(ValueError, match=r"sha256 mismatch.*corrupt: rebuild it"):
        LLMEngine(ModelConfig(str(built / "base"), device="cpu"))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(built / "base"), "--device", "cpu"])
    assert "model.safetensors changed" in str(exit_info.value.code)


def test_loading_a_corrupted_adapter_is_refused(built: Path, tiny_model_dir: Path) -> None:
    flip_a_byte(built / "lora" / "adapter_model.safetensors")
    engine = LLMEngine(ModelConfig(str(tiny_model_dir), device="cpu"), lora=LoraConfig())
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors changed"):
        engine.load_lora("x", str(built / "lora"))


def test_resaved_local_base_invalidates_its_variants(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "my-base"
    shutil.copytree(tiny_model_dir, base)
    assert {k: s for k, (s, _) in run(tmp_path, str(base)).items()} == {
        "base": "built",
        "lora": "built",
    }
    reads: list[Path] = []
    real = content_hash.file_sha256
    monkeypatch.setattr(content_hash, "file_sha256", lambda p: reads.append(p) or real(p))
    assert {k: s for k, (s, _) in run(tmp_path, str(base)).items()} == {
        "base": "reused",
        "lora": "reused",
    }
    assert reads == []  # unchanged files: hashes come from the cache
    weights = load_file(str(base / "model.safetensors"))
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3  # same size, new content, saved in place
    size = (base / "model.safetensors").stat().st_size
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    assert (base / "model.safetensors").stat().st_size == size
    assert {k: s for k, (s, _) in run(tmp_path, str(base)).items()} == {
        "base": "built",
        "lora": "built",
    }
    assert reads == [base / "model.safetensors"]


def test_lora_on_an_int8_wo_base_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        "name: q\nbase: demo-tiny\nvariants:\n"
        "  - {name: ql, steps: [{quantize: {method: int8-wo}}, {lora: {rank: 2, steps: 2}}]}\n"
    )
    recipe, ref = load_recipe(path)
    with pytest.raises(PipelineError, match=r"LoRA cannot train on a int8-wo.*bnb-nf4"):
        Pipeline(recipe, ref, tmp_path / "work").run()
    assert not (tmp_path / "work" / "variants" / "ql").exists()
    assert main(["validate", str(path)]) == 2
    assert "variants[0] (ql).steps[1].lora: LoRA cannot train" in capsys.readouterr().err


@pytest.mark.parametrize(("keep", "left"), [(1, ["step-4"]), (2, ["step-3", "step-4"])])
def test_training_keeps_only_the_newest_checkpoints(
    tmp_path: Path, keep: int, left: list[str]
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    rows = torch.randn(8, 4)
    config = TrainConfig(steps=5, lr=1e-2, batch_size=2, checkpoint_every=1, keep_checkpoints=keep)
    train(model, rows, lambda m, batch: m(batch).pow(2).mean(), config, checkpoint_dir=tmp_path)
    # none after the last step (5): the step's artifact follows, and its checkpoints go
    assert sorted(p.name for p in tmp_path.glob("step-*")) == left
    assert (tmp_path / "latest").read_text() == "step-4"


def test_interrupted_training_resumes_from_its_newest_checkpoint_to_the_same_weights(
    tmp_path: Path,
) -> None:
    """Killed during step 5 of 6 (checkpoints every 2 steps): the rerun starts after step 4 and
    ends with the weights and losses of a run never interrupted."""
    rows = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    config = TrainConfig(steps=6, lr=1e-2, batch_size=2, checkpoint_every=2)

    def loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).pow(2).mean()

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Linear(4, 4)

    whole = fresh()
    expected = train(whole, rows, loss, config, checkpoint_dir=tmp_path / "whole")
    calls = 0

    def dies_in_step_5(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise KeyboardInterrupt
        return loss(model, batch)

    with pytest.raises(KeyboardInterrupt):
        train(fresh(), rows, dies_in_step_5, config, checkpoint_dir=tmp_path / "cut")
    assert (tmp_path / "cut" / "latest").read_text() == "step-4"
    resumed_model = fresh()
    resumed = train(resumed_model, rows, loss, config, checkpoint_dir=tmp_path / "cut")
    assert resumed.resumed_from == 4 and resumed.losses == expected.losses
    assert torch.equal(resumed_model.weight, whole.weight)
    assert sorted(p.name for p in (tmp_path / "whole").glob("step-*")) == ["step-4"]


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_keep_checkpoints_below_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """0 used to be accepted and silently kept 1 (the newest is what an interrupted step resumes
    from): the flag now says what it allows before anything runs."""
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(tmp_path / "recipe.yaml"), "--keep-checkpoints", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--keep-checkpoints" in err and ("allowed: >= 1" in err or "not an integer" in err)


def test_measurements_run_under_the_work_dir_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: measurements ran after the work-dir lock was released, so a concurrent
    `--force` run could swap a variant under a running measurement (whose numbers were then
    stored under the old key)."""
    import fcntl

    import evals.measure
    from workbench.run_recipe import run as run_recipe

    seen: list[bool] = []
    measure = evals.measure.measure_variants

    def checking(*args: object, **kwargs: object) -> object:
        with (tmp_path / "work" / ".lock").open("a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                seen.append(True)  # held by the run: another run would wait here
            else:
                fcntl.flock(f, fcntl.LOCK_UN)
                seen.append(False)
        return measure(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(evals.measure, "measure_variants", checking)
    path = tmp_path / "recipe.yaml"
    path.write_text("name: tiny\nbase: demo-tiny\nvariants:\n  - {name: base, steps: []}\n")
    result = run_recipe(path, tmp_path / "work", report_dir=tmp_path / "report")
    assert seen == [True] and result.built == ["base"]
    with (tmp_path / "work" / ".lock").open("a") as f:  # released afterwards
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)

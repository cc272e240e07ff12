"""`benchmarks.demo_time`: the phases and timeline of a finished run, read from what it wrote."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from benchmarks.demo_time import Piece, clock, drop_variants, main, phase_spans, pieces, recipe_name
from workbench.recipe import load_recipe


def _write(path: Path, at: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")
    os.utime(path, (at, at))


def test_a_run_reads_as_its_phases_in_pipeline_order(tmp_path: Path) -> None:
    t0 = 1_000_000.0
    _write(tmp_path / ".venv" / ".installed", t0 + 60)
    run = tmp_path / "runs" / "demo"
    _write(run / "variants" / "base" / "workbench.json", t0 + 70)
    _write(run / "variants" / "int8" / "workbench.json", t0 + 75)
    _write(run / "variants" / "student" / "workbench.json", t0 + 300)
    _write(run / "evals" / "base" / "quality.json", t0 + 340)
    _write(run / "evals" / "base" / "divergence.json", t0 + 350)
    _write(run / "evals" / "int8" / "quality.json", t0 + 380)
    _write(run / "evals" / "student" / "divergence.json", t0 + 420)
    _write(run / "evals" / "base" / "server_check.json", t0 + 440)
    _write(run / "evals" / "base" / "answers.json", t0 + 445)
    _write(run / "evals" / "base" / "load.json", t0 + 480)
    _write(run / "evals" / "server-base.log", t0 + 481)  # not an eval: not a piece
    _write(run / "evals" / "base" / "notes.json", t0 + 482)  # an unknown file: not a piece
    _write(tmp_path / "reports" / "demo" / "report.json", t0 + 490)

    found = pieces(tmp_path, "demo")

    assert [p.what for p in found] == [
        "venv installed",
        "base built",
        "int8 built",
        "student built",
        "base quality",
        "base divergence",
        "int8 quality",
        "student divergence",
        "base server_check",
        "base answers",
        "base load",
        "report written",
    ]
    spans = phase_spans(t0, t0 + 495, found)
    assert spans == {
        "install": 60.0,
        "variants": 240.0,
        "evals": 120.0,
        "serving": 60.0,
        "report": 15.0,
    }
    assert sum(spans.values()) == 495.0


def test_a_run_that_stopped_early_has_only_the_phases_it_reached() -> None:
    found = [Piece(110.0, "install", "venv installed"), Piece(150.0, "variants", "base built")]
    assert phase_spans(100.0, 170.0, found) == {
        "install": 10.0,
        "variants": 40.0,
        "unfinished": 20.0,
    }


def test_clock_reads_minutes_and_seconds() -> None:
    assert clock(0.4) == "0:00"
    assert clock(59.6) == "1:00"
    assert clock(1611.0) == "26:51"


def test_the_recipe_name_is_read_from_the_recipe_of_the_target(tmp_path: Path) -> None:
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "demo.yaml").write_text("# a comment\nname: demo\nbase: x\n")
    assert recipe_name(tmp_path, "demo") == "demo"
    with pytest.raises(SystemExit, match="--target test: this script times"):
        recipe_name(tmp_path, "test")


def test_the_repository_recipes_name_their_run_directories() -> None:
    root = Path(__file__).resolve().parents[2]
    assert recipe_name(root, "demo") == "demo"
    assert recipe_name(root, "demo-toy") == "demo-toy"


def test_dropping_a_variant_leaves_the_others_as_the_recipe_defines_them(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    recipe = tmp_path / "demo.yaml"
    shutil.copy(root / "recipes" / "demo.yaml", recipe)
    before, _ = load_recipe(recipe)

    assert drop_variants(recipe, ["student-removal"]) == len(before.variants) - 1

    after, _ = load_recipe(recipe)
    assert [v.name for v in after.variants] == [
        v.name for v in before.variants if v.name != "student-removal"
    ]
    kept = {v.name: v for v in before.variants}
    for variant in after.variants:  # the anchors' settings, expanded, are the same settings
        assert variant == kept[variant.name]
    assert after.evals == before.evals


def test_dropping_a_name_the_recipe_lacks_names_its_variants(tmp_path: Path) -> None:
    recipe = tmp_path / "demo.yaml"
    recipe.write_text("name: demo\nbase: demo\nvariants:\n  - {name: base, steps: []}\n")
    with pytest.raises(
        SystemExit, match=re.escape("--drop studnet: not a variant of demo.yaml (it has base)")
    ):
        drop_variants(recipe, ["studnet"])
    assert "studnet" not in recipe.read_text() and "base" in recipe.read_text()  # untouched


def test_dropping_every_variant_is_refused_by_the_recipe_check(tmp_path: Path) -> None:
    recipe = tmp_path / "demo.yaml"
    recipe.write_text("name: demo\nbase: demo\nvariants:\n  - {name: base, steps: []}\n")
    with pytest.raises(SystemExit, match="--drop base: "):
        drop_variants(recipe, ["base"])


def test_an_existing_keep_directory_is_refused_before_anything_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(SystemExit, match=r"--keep .*kept: exists; give a new directory"):
        main(["--keep", str(kept)])
    assert list(scratch_root.iterdir()) == []


def test_a_run_that_fails_before_make_leaves_no_scratch_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "README.md").write_text("x\n")
    subprocess.run([*git, "add", "README.md"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))
    with pytest.raises(subprocess.CalledProcessError):
        main(["--repo", str(repo), "--commit", "no-such-commit"])
    assert list(scratch_root.iterdir()) == []

"""The pipeline: manifests, reuse of unchanged variants, rebuilds, and interrupted runs."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from compress.artifact import MANIFEST, dir_bytes, verify_files
from workbench.cli import main
from workbench.pipeline import Pipeline
from workbench.recipe import load_recipe

RECIPE = """\
name: tiny
base: demo-tiny
variants:
  - {name: base, steps: []}
  - {name: twice, steps: [{identity: {}}, {identity: {}}]}
"""


def _run(tmp_path: Path, text: str = RECIPE, force: bool = False) -> dict[str, str]:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    recipe, base = load_recipe(path)
    results = Pipeline(recipe, base, tmp_path / "work", force=force).run()
    return {r.name: r.status for r in results}


def _manifest(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "work" / "variants" / name / MANIFEST).read_text())


def test_manifest_records_what_was_built(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert _run(tmp_path) == {"base": "built", "twice": "built"}
    variant_dir = tmp_path / "work" / "variants" / "base"
    m = _manifest(tmp_path, "base")
    weights = load_file(variant_dir / "model.safetensors")
    assert m["parameters"] == sum(t.numel() for t in weights.values())
    assert m["bytes_on_disk"] == dir_bytes(variant_dir) - (variant_dir / MANIFEST).stat().st_size
    assert m["kind"] == "model" and m["variant"] == "base"
    assert m["recipe"]["name"] == "tiny" and len(m["recipe"]["hash"]) == 16
    assert m["base"] == {"kind": "demo", "name": "demo-tiny"}
    assert [s["name"] for s in m["steps"]] == ["identity"] and m["hash"] == m["steps"][-1]["hash"]
    assert m["parent"]["path"] == str(tiny_model_dir)
    assert m["packages"]["torch"] == importlib.metadata.version("torch")
    assert m["wall_seconds"] >= 0 and m["peak_memory_bytes"] > 50_000_000
    # a two-step variant's parent is the first step's artifact, shared by hash
    twice = _manifest(tmp_path, "twice")
    first = tmp_path / "work" / "artifacts" / twice["steps"][0]["hash"]
    assert twice["parent"] == {"path": str(first), "hash": twice["steps"][0]["hash"]}
    assert json.loads((first / MANIFEST).read_text())["hash"] == twice["steps"][0]["hash"]


def test_variant_loads_as_a_transformers_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    _run(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "work" / "variants" / "twice")
    assert model.config.model_type == "llama"


def test_rerun_reuses_and_changes_rebuild(tmp_path: Path) -> None:
    _run(tmp_path)
    created = _manifest(tmp_path, "base")["created"]
    assert _run(tmp_path) == {"base": "reused", "twice": "reused"}
    changed = RECIPE.replace(
        "{identity: {}}, {identity: {}}", "{identity: {}}, {identity: {}}, {identity: {}}"
    )
    assert _run(tmp_path, changed) == {"base": "reused", "twice": "built"}
    assert len(_manifest(tmp_path, "twice")["steps"]) == 3
    assert _run(tmp_path, "seed: 7\n" + changed) == {"base": "built", "twice": "built"}
    assert _run(tmp_path, "seed: 7\n" + changed, force=True) == {"base": "built", "twice": "built"}
    assert _manifest(tmp_path, "base")["created"] >= created


def test_cli_run_says_what_it_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text(RECIPE)
    assert main(["run", "r.yaml", "--variant", "base"]) == 0
    out = capsys.readouterr().out
    assert "built 1 variant(s) ['base']" in out
    assert (tmp_path / "runs" / "tiny" / "variants" / "base" / MANIFEST).is_file()
    assert not (tmp_path / "runs" / "tiny" / "variants" / "twice").exists()


# The child runs the real pipeline with the identity step slowed down after it has written part of
# its output, so the test can kill it mid-write.
_SLOW_CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from compress.identity import Identity
    original = Identity.apply
    def slow_apply(self, artifact, ctx):
        made = original(self, artifact, ctx)
        Path(sys.argv[2]).write_text(str(ctx.out_dir))
        time.sleep(600)
        return made
    Identity.apply = slow_apply
    from workbench.cli import main
    sys.exit(main(["run", sys.argv[1], "--work-dir", sys.argv[3]]))
    """
)


@pytest.mark.e2e
def test_killed_run_leaves_no_half_written_variant(tmp_path: Path, tiny_model_dir: Path) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    marker, work = tmp_path / "writing", tmp_path / "work"
    child = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CHILD, str(recipe), str(marker), str(work)], env=os.environ
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the child never reached the step"
        partial = Path(marker.read_text())
        assert (partial / "model.safetensors").exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert partial.exists() and partial.parent == work / "variants"
    assert not (work / "variants" / "base").exists()
    assert _run(tmp_path) == {"base": "built", "twice": "built"}
    assert not partial.exists()
    leftovers = [
        p.name
        for d in ("variants", "artifacts")
        for p in (work / d).iterdir()
        if p.name.startswith(".")
    ]
    assert leftovers == []


def test_divergence_without_its_reference_in_the_run_is_skipped(tmp_path: Path) -> None:
    """`workbench run --variant int8` builds only int8: the divergence eval, whose reference is
    `base`, is skipped (it used to raise StopIteration)."""
    from compress.manifest import Manifest
    from evals.measure import measure_variants
    from evals.variant import VariantResult
    from evals.variant_evals import Measurements, divergence_result
    from workbench.recipe import load_recipe

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        "name: r\nbase: demo-tiny\nvariants: [{name: base}, {name: int8}]\n"
        "evals: {divergence: {reference: base}}\n"
    )
    recipe, _ = load_recipe(recipe_file)
    manifest = Manifest.model_construct(hash="x", kind="model")  # what the evals read of it
    only = VariantResult("int8", tmp_path / "int8", "reused", manifest)
    assert divergence_result(recipe.evals, only, [only], tmp_path, False) == (None, False)
    said: list[str] = []
    measured = measure_variants(recipe.evals, [only], tmp_path, progress=said.append)
    assert measured == Measurements() and not (tmp_path / "evals").exists()
    assert said == ["divergence int8: skipped, 'base' is not in this run (--variant base)"]


def test_the_manifest_file_is_what_its_typed_record_writes(tmp_path: Path) -> None:
    """`Manifest.read` then `to_json` gives back the file byte for byte (sorted keys), so the
    typed record changed nothing on disk."""
    from compress.manifest import Manifest

    results = _run(tmp_path)
    assert results["base"] == "built"
    path = tmp_path / "work" / "variants" / "base"
    manifest = Manifest.read(path)
    assert manifest is not None and manifest.variant == "base" and manifest.eval is None
    written = json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n"
    assert (path / MANIFEST).read_text() == written


TWINS = """\
name: twins
base: demo-tiny
variants:
  - {name: int8, steps: [{quantize: {method: int8-wo}}]}
  - {name: int8-kv8, steps: [{quantize: {method: int8-wo}}], serve: {kv_cache_dtype: int8}}
"""


def test_a_variant_differing_only_in_serve_settings_mirrors_its_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two variants with the same steps (one served with an int8 KV cache) quantize once: the
    second mirrors the first's artifact with hard links, its manifest naming itself, without
    reading the files this run just wrote again; a twin whose files changed is not mirrored;
    `force` builds both."""
    path = tmp_path / "recipe.yaml"
    path.write_text(TWINS)
    recipe, base = load_recipe(path)
    verified: list[str] = []

    def counting_verify(where: Path, files: object) -> str | None:
        verified.append(Path(where).name)
        return verify_files(where, files)

    monkeypatch.setattr("workbench.pipeline.verify_files", counting_verify)
    results = Pipeline(recipe, base, tmp_path / "work").run()
    assert [(r.name, r.status) for r in results] == [("int8", "built"), ("int8-kv8", "reused")]
    assert verified == []  # the twin was written by this run: not hashed again
    rerun = Pipeline(recipe, base, tmp_path / "work").run()
    assert [r.status for r in rerun] == ["reused", "reused"]
    assert verified == ["int8", "int8-kv8"]  # each verified once, as its own reuse
    assert [r.serve.kv_cache_dtype for r in results] == ["auto", "int8"]
    first, second = _manifest(tmp_path, "int8"), _manifest(tmp_path, "int8-kv8")
    assert second["variant"] == "int8-kv8" and second["hash"] == first["hash"]
    assert {k: v for k, v in second.items() if k != "variant"} == {
        k: v for k, v in first.items() if k != "variant"
    }  # how and when it was built: the one build's
    weights = [
        tmp_path / "work" / "variants" / n / "model.safetensors" for n in ("int8", "int8-kv8")
    ]
    assert weights[0].stat().st_ino == weights[1].stat().st_ino
    # the twin's weights changed (and the mirror dropped): the second variant builds its own
    shutil.rmtree(tmp_path / "work" / "variants" / "int8-kv8")
    weights[0].unlink()
    weights[0].write_bytes(b"damaged")
    again = Pipeline(recipe, base, tmp_path / "work").run(only=["int8-kv8"])
    assert [(r.name, r.status) for r in again] == [("int8-kv8", "built")]
    assert weights[1].stat().st_ino != weights[0].stat().st_ino and load_file(weights[1])
    forced = Pipeline(recipe, base, tmp_path / "work", force=True).run()
    assert [r.status for r in forced] == ["built", "built"]

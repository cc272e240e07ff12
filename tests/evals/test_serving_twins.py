"""Serving twins: which variants share a load measurement (the signature), and the serving evals
ramping one of each twin set, the others taking its result, on real built variants of the tiny
model (the server and the ramp replaced by counters: what is measured where, not how fast)."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import evals.load_cli
import evals.serving_evals
from compress.artifact import artifact_from_manifest
from evals.results import LoadResult
from evals.serving_evals import measure_serving
from evals.serving_twins import serving_signature
from evals.settings import Evals, ServeSettings
from evals.variant import VariantResult
from evals.variant_evals import Measurements
from reports.sittings import twin_lines
from workbench.pipeline import Pipeline
from workbench.recipe import load_recipe

TWINS = """\
name: twins
base: demo-tiny
variants:
  - {name: base, steps: []}
  - {name: first, steps: [{distill: {layers: [0], steps: 0, seq_len: 32}}]}
  - {name: last, steps: [{distill: {layers: [1], steps: 0, seq_len: 32}}]}
  - name: lora-a
    steps: [{lora: &l {rank: 4, targets: [q_proj, v_proj], steps: 1, batch_size: 2, seq_len: 32}}]
  - {name: lora-b, steps: [{lora: {<<: *l, lr: 0.01}}]}
  - {name: lora-r8, steps: [{lora: {<<: *l, rank: 8}}]}
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> list[VariantResult]:
    root = tmp_path_factory.mktemp("twins")
    (root / "recipe.yaml").write_text(TWINS)
    recipe, base = load_recipe(root / "recipe.yaml")
    return Pipeline(recipe, base, root / "work").run()


def _by_name(built: list[VariantResult]) -> dict[str, VariantResult]:
    return {r.name: r for r in built}


def _signature(r: VariantResult) -> str | None:
    base = artifact_from_manifest(r.path).base
    return serving_signature(r, r.path if base is None else base)


def test_same_shapes_formats_and_settings_are_twins(built: list[VariantResult]) -> None:
    v = _by_name(built)
    assert _signature(v["first"]) is not None
    assert _signature(v["first"]) == _signature(v["last"])  # other layers, same shapes
    assert _signature(v["first"]) != _signature(v["base"])  # two layers
    assert _signature(v["lora-a"]) == _signature(v["lora-b"])  # other weights, same shape
    assert _signature(v["lora-a"]) != _signature(v["lora-r8"])
    kv8 = VariantResult(**{**v["last"].__dict__, "serve": ServeSettings(kv_cache_dtype="int8")})
    assert _signature(kv8) != _signature(v["last"])


def test_int8_with_outlier_columns_is_nobodys_twin(
    built: list[VariantResult], tmp_path: Path
) -> None:
    source = _by_name(built)["base"]
    copy = tmp_path / "int8"
    shutil.copytree(source.path, copy)
    config = json.loads((copy / "config.json").read_text())
    q = {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 6.0}
    (copy / "config.json").write_text(json.dumps({**config, "quantization_config": q}))
    variant = VariantResult(**{**source.__dict__, "path": copy})
    assert serving_signature(variant, copy) is None
    q["llm_int8_threshold"] = 0.0  # no outlier path: the work is the same for any weights
    (copy / "config.json").write_text(json.dumps({**config, "quantization_config": q}))
    assert serving_signature(variant, copy) is not None


def _fake_load(model: str) -> LoadResult:
    server = {"model": model, "max_model_len": 64, "kv_blocks": 8, "block_size": 8}
    return LoadResult.from_json(
        {
            "server": {**server, "kv_bytes_per_token": 1},
            "kv_tokens": 64,
            "points": [],
            "saturation": {},
        }
    )


def test_one_ramp_per_twin_set_the_others_take_its_result(
    built: list[VariantResult], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swept: list[str] = []
    servers: list[str] = []

    @contextlib.contextmanager
    def served(model: str, flags: list[str], log: Path) -> Iterator[str]:
        servers.append(Path(model).name)
        yield "http://fake"

    def sweep(url: str, load: object, model: str) -> LoadResult:
        swept.append(model)
        return _fake_load(model)

    monkeypatch.setattr(evals.load_cli, "served", served)
    monkeypatch.setattr(evals.serving_evals, "_sweep", sweep)
    monkeypatch.setattr(evals.serving_evals, "_post", lambda url, route, body: None)
    monkeypatch.setattr(evals.serving_evals, "adapter_requests", lambda url, name: 1.0)
    settings = Evals.model_validate({"load": {"concurrency": [1], "prompt_len": [8]}})
    out, said = Measurements(), list[str]()
    measure_serving(settings, built, tmp_path, False, out, said.append)
    assert swept == ["base", "first", "lora-a", "lora-r8"]
    assert out.load["last"].measured_on == "first"
    assert out.load["lora-b"].measured_on == "lora-a"
    assert out.load["last"].server == out.load["first"].server  # the same measurement
    assert all(out.load[n].measured_on is None for n in swept)
    assert "load last: as first (serving twin)" in said
    assert "last" not in servers  # nothing of its own to measure: no server started
    stored = json.loads((tmp_path / "evals" / "lora-b" / "load.json").read_text())
    assert stored["result"]["measured_on"] == "lora-a"
    report = {"variants": [{"name": n, "load": r.to_json()} for n, r in out.load.items()]}
    lines = twin_lines(report)
    assert len(lines) == 2 and lines[0].startswith("last: serving figures measured on first")

    # a rerun reuses the measured ones and takes the twins' copies again from them
    swept.clear()
    again, said = Measurements(), list[str]()
    measure_serving(settings, built, tmp_path, False, again, said.append)
    assert swept == [] and again.load["last"].measured_on == "first"
    assert sorted(again.reused) == ["base/load", "first/load", "lora-a/load", "lora-r8/load"]

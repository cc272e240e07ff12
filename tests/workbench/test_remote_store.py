"""Storage at an fsspec URL, with the local executor (fsspec's in-memory file system stands in
for a bucket): artifacts pushed with their manifest last, a rerun from an empty mirror reusing
every committed hash, a half-pushed artifact rebuilt, a corrupted one refused, the lease held at
the URL, a URL no backend reads refused before any work."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import fsspec
import pytest

from compress.artifact import MANIFEST, verify_files
from tests.workbench.toy_recipes import FOUR_VARIANTS
from workbench.executor import LocalExecutor
from workbench.lease import LEASE, LeaseError
from workbench.remote_store import MIRROR_ENV, RemoteStore, mirror_dir
from workbench.run_recipe import RunResult, run
from workbench.storage import StorageError

pytestmark = pytest.mark.e2e

RECIPE = FOUR_VARIANTS


@pytest.fixture
def bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(MIRROR_ENV, str(tmp_path / "mirrors"))
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    return f"memory://bucket-{uuid.uuid4().hex[:8]}/run"


def _run(tmp_path: Path, url: str) -> RunResult:
    return run(
        tmp_path / "recipe.yaml", url, report_dir=tmp_path / "report", executor=LocalExecutor()
    )


def _remote(url: str) -> tuple[object, str]:
    return fsspec.core.url_to_fs(url)


def test_a_run_at_a_url_commits_there_and_a_rerun_from_an_empty_mirror_reuses_it(
    tmp_path: Path, bucket: str
) -> None:
    first = _run(tmp_path, bucket)
    assert first.built == ["base", "twice", "int8"] and first.reused == ["int8-kv8"]
    fs, root = _remote(bucket)
    committed = sorted(
        p[len(root) + 1 :].rsplit("/", 1)[0] for p in fs.find(root) if p.endswith(MANIFEST)
    )
    assert len(committed) == 5  # 4 variants and the first step of twice
    for rel in committed:  # each committed dir holds exactly the files its manifest names
        manifest = json.loads(fs.cat_file(f"{root}/{rel}/{MANIFEST}"))
        names = {p[len(f"{root}/{rel}/") :] for p in fs.find(f"{root}/{rel}")} - {MANIFEST}
        assert names == set(manifest["files"])
    stored = {p.rsplit("/", 2)[-2] for p in fs.find(f"{root}/evals")}
    assert stored == {"base", "twice", "int8", "int8-kv8"}
    assert not fs.exists(f"{root}/{LEASE}")  # released with the run
    shutil.rmtree(mirror_dir(bucket))  # another machine: nothing local
    again = _run(tmp_path, bucket)
    assert again.built == [] and again.reused == ["base", "twice", "int8", "int8-kv8"]
    assert again.measurements is not None
    assert again.measurements.reused == [f"{v}/quality" for v in again.reused]
    ppl = {v: q.tasks["corpus_ppl"] for v, q in again.measurements.quality.items()}
    assert first.measurements is not None
    assert ppl == {v: q.tasks["corpus_ppl"] for v, q in first.measurements.quality.items()}
    for v in again.variants:  # pulled for the report, verified
        assert verify_files(v.path, v.manifest.files) is None


def test_a_half_pushed_artifact_is_not_read_but_rebuilt(tmp_path: Path, bucket: str) -> None:
    (tmp_path / "recipe.yaml").write_text(RECIPE.split("  - {name: twice")[0])
    _run(tmp_path, bucket)
    fs, root = _remote(bucket)
    fs.rm_file(f"{root}/variants/base/{MANIFEST}")  # the push died before its last file
    shutil.rmtree(mirror_dir(bucket))
    again = _run(tmp_path, bucket)
    assert again.built == ["base"]
    assert fs.exists(f"{root}/variants/base/{MANIFEST}")


def test_a_corrupted_committed_artifact_is_refused_naming_the_file_and_the_fix(
    tmp_path: Path, bucket: str
) -> None:
    (tmp_path / "recipe.yaml").write_text(RECIPE.split("  - {name: int8,")[0])
    _run(tmp_path, bucket)
    fs, root = _remote(bucket)
    weights = next(p for p in fs.find(f"{root}/variants/twice") if p.endswith(".safetensors"))
    fs.pipe_file(weights, b"not the weights")
    shutil.rmtree(mirror_dir(bucket))
    with pytest.raises(StorageError) as raised:
        _run(tmp_path, bucket)
    name = weights.rsplit("/", 1)[-1]
    assert f"{bucket}/variants/twice: committed, but {name}" in str(raised.value)
    assert "delete that dir at the URL so the next run builds it again" in str(raised.value)
    assert not (Path(mirror_dir(bucket)) / "variants" / "twice").exists()  # nothing half-pulled


def test_a_fresh_lease_at_the_url_refuses_a_second_driver(tmp_path: Path, bucket: str) -> None:
    fs, root = _remote(bucket)
    held = {"run_id": "other", "host": "node-9", "pid": 1, "heartbeat": time.time()}
    fs.pipe_file(f"{root}/{LEASE}", json.dumps(held).encode())
    with pytest.raises(LeaseError, match="run other of the driver node-9:1 holds"):
        _run(tmp_path, bucket)
    assert not fs.exists(f"{root}/variants")


def test_a_url_no_installed_backend_reads_is_refused_before_any_work(tmp_path: Path) -> None:
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    with pytest.raises(StorageError, match=r"nosuch:// is not readable here .*fsspec backend"):
        RemoteStore.at("nosuch://bucket/run")
    with pytest.raises(StorageError, match=r"pip install s3fs"):
        _run(tmp_path, "s3://bucket/run")

"""Two machines that share no dir, on one: a worker node in a mount namespace of its own
(`unshare -m`) with a private tmpfs over a dir, as a machine with a local dir at the same path;
the head runs the driver and no task (0 CPUs). Storage at that dir is refused before any work,
naming the node and the fix; storage at a URL (`local://`, read through fsspec like `s3://`)
works: the node builds and measures in its own mirror, and the driver sees only the URL."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workbench.storage import StorageError

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.e2e

ONE = "name: one\nbase: demo-tiny\ndevice: cpu\nvariants:\n  - {name: base, steps: []}\n"


def _can_unshare(tmp: Path) -> str | None:
    """Why this machine cannot give a process a private mount, or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs none {tmp}"],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"unshare -m refused: {probe.stderr.strip()}"


@pytest.fixture(scope="module")
def blind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any]]:
    """The dir, and a cluster of a head (no CPU) and a node that sees its own tmpfs there."""
    from ray.cluster_utils import Cluster

    storage = tmp_path_factory.mktemp("storage")
    if reason := _can_unshare(storage):
        pytest.skip(reason)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    start = f"{sys.executable} -m tests.workbench.blind_node {cluster.address}"
    node = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs none {storage} && exec {start}"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while sum(n["Alive"] for n in ray.nodes()) < 2:
        assert node.poll() is None and time.monotonic() < deadline, "the blind node never joined"
        time.sleep(0.2)
    yield storage, cluster
    os.killpg(node.pid, signal.SIGTERM)
    node.wait(timeout=60)
    ray.shutdown()
    cluster.shutdown()


def test_a_storage_dir_one_node_does_not_share_is_refused_before_any_work(
    blind: tuple[Path, Any], tmp_path: Path
) -> None:
    from workbench.ray_executor import RayExecutor
    from workbench.run_recipe import run

    storage, _ = blind
    (tmp_path / "one.yaml").write_text(ONE)
    with pytest.raises(StorageError) as raised:
        run(tmp_path / "one.yaml", storage / "work", executor=RayExecutor())
    message = str(raised.value)
    assert f"--storage {storage / 'work'}: not shared: node(s) 127.0.0.1" in message
    assert "cannot see or write what this driver wrote there" in message
    assert "pass a dir every node mounts at the same path" in message
    assert sorted(p.name for p in (storage / "work").iterdir()) == []  # no work, no probe left


TWO = """\
name: two
base: demo-tiny
device: cpu
variants:
  - {name: base, steps: []}
  - {name: twice, steps: [{identity: {}}, {identity: {}}]}
evals:
  quality: [{task: corpus_ppl, limit: 4}]
  max_length: 32
"""


def test_storage_at_a_url_runs_on_a_node_that_shares_no_dir_with_the_driver(
    blind: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from compress.artifact import MANIFEST
    from workbench.ray_executor import RayExecutor
    from workbench.remote_store import MIRROR_ENV, mirror_dir
    from workbench.run_recipe import run

    storage, _ = blind
    monkeypatch.setenv(MIRROR_ENV, str(storage / "mirrors"))  # the node's own tmpfs there
    url = f"local://{tmp_path / 'bucket'}"
    (tmp_path / "two.yaml").write_text(TWO)
    lines: list[str] = []
    result = run(
        tmp_path / "two.yaml",
        url,
        report_dir=tmp_path / "report",
        executor=RayExecutor(),
        progress=lines.append,
    )
    assert result.built == ["base", "twice"]
    assert result.measurements is not None and sorted(result.measurements.quality) == [
        "base",
        "twice",
    ]
    bucket = tmp_path / "bucket"
    committed = sorted(p.parent.relative_to(bucket).as_posix() for p in bucket.rglob(MANIFEST))
    assert len(committed) == 3 and committed[-2:] == ["variants/base", "variants/twice"]
    mirror = Path(mirror_dir(url))
    assert not (mirror / "artifacts").exists()  # built on the node, never needed here
    assert sorted(p.name for p in (mirror / "variants").iterdir()) == ["base", "twice"]  # report
    for label in ("build base (identity)", "quality twice"):  # the node's status, via the URL
        assert any(line.startswith("running") and label in line for line in lines), label
    assert (tmp_path / "report" / "report.json").is_file()
    assert not (bucket / ".tasks").exists() or not any((bucket / ".tasks").iterdir())

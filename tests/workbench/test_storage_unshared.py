"""A storage dir one node of the cluster does not share: that node runs in a mount namespace of
its own (`unshare -m`) with a private tmpfs over the dir, as a machine with a local dir at the
same path would. The run is refused before any work, naming the node and the fix."""

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
    """The shared dir, and a cluster of a head (1 CPU) and a node that sees its own tmpfs there."""
    from ray.cluster_utils import Cluster

    storage = tmp_path_factory.mktemp("storage")
    if reason := _can_unshare(storage):
        pytest.skip(reason)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
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

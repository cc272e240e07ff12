"""A node lost mid-task on a two-node Ray cluster (`ray.cluster_utils.Cluster`): the task is
retried on the other node, and exactly one artifact is committed, with no half-written dir."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from compress.artifact import MANIFEST, verify_files
from workbench.storage import GATE_ENV

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.e2e

ONE = "name: one\nbase: demo-tiny\ndevice: cpu\nvariants:\n  - {name: base, steps: []}\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    """A head that runs no task (the driver's) and two worker nodes of one CPU each."""
    from ray.cluster_utils import Cluster

    gate = tmp_path_factory.mktemp("gate")
    os.environ[GATE_ENV] = str(gate)  # inherited by every node's workers
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = Cluster(
        initialize_head=True,
        connect=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster, gate
    ray.shutdown()
    cluster.shutdown()
    del os.environ[GATE_ENV]


def _wait(predicate: Callable[[], Any], what: str, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return found


def _raylet_of(cluster: Any, pid: int) -> Any:
    """The cluster node whose raylet started the worker `pid`."""
    status = Path(f"/proc/{pid}/status").read_text()
    parent = int(next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1])
    return next(
        n for n in cluster.worker_nodes if n.all_processes["raylet"][0].process.pid == parent
    )


def test_a_node_removed_mid_task_is_retried_on_the_other(
    cluster: tuple[Any, Path], tmp_path: Path
) -> None:
    from workbench.base_model import base_fingerprint
    from workbench.ray_executor import RayExecutor
    from workbench.recipe import load_recipe
    from workbench.run_recipe import run
    from workbench.task_graph import chain

    ray_cluster, gate = cluster
    (tmp_path / "one.yaml").write_text(ONE)
    recipe, base = load_recipe(tmp_path / "one.yaml")
    hash_ = chain(recipe.variants[0], base_fingerprint(base), 0)[-1].hash
    (gate / f"{hash_}.hold").write_text("")
    lines: list[str] = []
    outcome: dict[str, Any] = {}

    def drive() -> None:
        outcome["result"] = run(
            tmp_path / "one.yaml",
            tmp_path / "work",
            report_dir=tmp_path / "report",
            executor=RayExecutor(),
            progress=lines.append,
        )

    def waiting() -> set[int]:
        return {int(p.name.rsplit("-", 1)[1]) for p in gate.glob(f"{hash_}.waiting-*")}

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        (first,) = _wait(waiting, "the first attempt at the gate")
        lost = _raylet_of(ray_cluster, first)
        ray_cluster.remove_node(lost, allow_graceful=False)
        (second,) = _wait(lambda: waiting() - {first}, "the retry on the other node")
        assert _raylet_of(ray_cluster, second) is not lost
        variants = tmp_path / "work" / "variants"
        assert [p.name.split("-")[1] for p in variants.glob(".base.tmp-*")] == [str(second)]
    finally:
        (gate / f"{hash_}.hold").unlink()
        driver.join(timeout=300)
    assert outcome["result"].built == ["base"]
    assert [p.name for p in variants.iterdir()] == ["base"]  # one artifact, nothing half-written
    manifest = json.loads((variants / "base" / MANIFEST).read_text())
    assert verify_files(variants / "base", manifest["files"]) is None
    assert any(line.startswith("retried") and "build base" in line for line in lines), lines
    ray_cluster.add_node(num_cpus=1)  # leave the module's cluster as it was


def test_a_load_eval_on_a_cluster_without_load_slots_is_refused_before_any_work(
    cluster: tuple[Any, Path], tmp_path: Path
) -> None:
    """This cluster's nodes declare no `workbench_load_slot`: the serving task could never start."""
    from workbench.executor import ExecutorError
    from workbench.ray_executor import RayExecutor
    from workbench.run_recipe import run

    text = ONE + "evals:\n  load: {concurrency: [1], prompt_len: [16], max_tokens: 4}\n"
    (tmp_path / "load.yaml").write_text(text)
    with pytest.raises(ExecutorError) as raised:
        run(tmp_path / "load.yaml", tmp_path / "work", executor=RayExecutor())
    message = str(raised.value)
    assert "serving (load ramps, chat, server check) asks for" in message
    assert """start each node with --resources '{"workbench_load_slot": 1}'""" in message
    assert not (tmp_path / "work" / "variants").exists()

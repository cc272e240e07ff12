"""The Ray executor on an in-process cluster (2 CPUs, 2 fake GPUs, one load slot): the same
artifacts as the local executor, GPU-shaped tasks on the declared GPUs, a worker killed just
before its manifest, the driver killed mid-run and rerun, tasks no node can hold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from compress.artifact import MANIFEST, verify_files
from tests.workbench.toy_recipes import FOUR_VARIANTS
from workbench.executor import ExecutorError, LocalExecutor, TaskEvent, describe
from workbench.resources import LOAD_SLOT
from workbench.run_recipe import RunResult, run
from workbench.storage import GATE_ENV

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.e2e

RECIPE = FOUR_VARIANTS
VOLATILE = {"wall_seconds", "created", "peak_memory_bytes", "peak_cuda_memory_bytes"}


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The cluster, whose workers wait at the commit gate of every hash the test holds."""
    gate = tmp_path_factory.mktemp("gate")
    os.environ[GATE_ENV] = str(gate)  # inherited by the raylet's workers
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(
        num_cpus=2,
        num_gpus=2,
        resources={LOAD_SLOT: 1},
        include_dashboard=False,
        log_to_driver=False,
    )
    yield gate
    ray.shutdown()
    del os.environ[GATE_ENV]


def _ray(tmp_path: Path, name: str, text: str = RECIPE, **kw: Any) -> tuple[RunResult, list[str]]:
    from workbench.ray_executor import RayExecutor

    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    lines: list[str] = []
    result = run(
        path,
        tmp_path / name,
        report_dir=tmp_path / f"{name}-report",
        executor=RayExecutor(),
        progress=lines.append,
        **kw,
    )
    return result, lines


def _manifests(work: Path) -> dict[str, dict]:
    found = {}
    for file in sorted(work.glob(f"*/*/{MANIFEST}")):
        m = json.loads(file.read_text())
        m["parent"]["path"] = m["parent"]["path"].replace(str(work), "WORK")
        m["eval"].pop("load_seconds")
        found[file.parent.relative_to(work).as_posix()] = {
            k: v for k, v in m.items() if k not in VOLATILE
        }
    return found


def test_ray_writes_the_manifests_and_hashes_the_local_executor_writes(
    gate: Path, tmp_path: Path
) -> None:
    path = tmp_path / "local.yaml"
    path.write_text(RECIPE)
    local = run(path, tmp_path / "local", report_dir=tmp_path / "lr", executor=LocalExecutor())
    result, lines = _ray(tmp_path, "ray")
    assert _manifests(tmp_path / "ray") == _manifests(tmp_path / "local")
    assert len(_manifests(tmp_path / "ray")) == 5  # 4 variants and the first step of twice
    assert result.built == local.built == ["base", "twice", "int8"]
    assert result.reused == ["int8-kv8"]  # the twin mirrors int8's build
    ray_ppl = {v: q.tasks["corpus_ppl"] for v, q in result.measurements.quality.items()}
    assert ray_ppl == {v: q.tasks["corpus_ppl"] for v, q in local.measurements.quality.items()}
    for label in ("build base (identity)", "mirror int8-kv8 (as int8)", "quality twice"):
        assert any(line.startswith("running") and label in line for line in lines), label
        assert any(line.startswith("done") and label in line for line in lines), label
    assert list((tmp_path / "ray" / ".tasks").iterdir()) == []  # each run's records removed
    again, lines = _ray(tmp_path, "ray")  # a rerun skips every committed hash
    assert again.built == [] and again.reused == ["base", "twice", "int8", "int8-kv8"]
    assert not any("build" in line or "mirror" in line for line in lines)
    assert again.measurements.reused == [f"{v}/quality" for v in again.reused]


GPU_RECIPE = """\
name: gpus
base: demo-tiny
variants:
  - {name: base, steps: []}
  - {name: twice, steps: [{identity: {}}, {identity: {}}], resources: {gpus: 1}}
  - {name: int8, steps: [{quantize: {method: bnb-int8}}], resources: {gpus: 1}}
  - {name: int8-kv8, steps: [{quantize: {method: bnb-int8}}], serve: {kv_cache_dtype: int8}}
"""


def test_gpu_shaped_tasks_run_on_the_declared_gpus(gate: Path, tmp_path: Path) -> None:
    from tests.workbench.ray_probe import GpuProbe
    from workbench.pipeline import Pipeline
    from workbench.ray_executor import RayExecutor
    from workbench.recipe import load_recipe

    path = tmp_path / "gpu.yaml"
    path.write_text(GPU_RECIPE)
    recipe, base = load_recipe(path)
    pipeline = Pipeline(recipe, base, tmp_path / "w")
    executor = RayExecutor()
    assert executor.prepare(recipe, tmp_path / "w") is True  # the cluster has GPUs
    graph = pipeline.graph(recipe.variants, measure=False, gpus=True)
    events: list[TaskEvent] = []
    results = executor.run(list(graph.nodes.values()), {}, GpuProbe(), events.append)
    shaped = [k for k, n in graph.nodes.items() if n.shape.gpus]
    # twice's second step and int8's build: twice's first step is base's build (mirrored), and
    # int8-kv8 mirrors int8; neither mirror holds a GPU
    assert [graph.nodes[k].label for k in shaped] == [
        "build twice (identity)",
        "build int8 (quantize)",
    ]
    for key in shaped:
        gpus, _ = results[key]
        assert len(gpus) == 1 and gpus[0] in (0, 1), key
    pids = [results[k][1] for k in shaped]
    assert len(set(pids)) == 2  # one process per GPU task
    unshaped = [results[k][0] for k, n in graph.nodes.items() if not n.shape.gpus]
    assert unshaped and all(g == [] for g in unshaped)
    assert {e.state for e in events} >= {"queued", "running", "done"}


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ("{gpus: 3}", "build base (identity) asks for CPU 1, GPU 3"),
        ("{accelerator_type: H100}", "accelerator_type:H100"),
        ("{cpus: 64}", "CPU 64"),
    ],
)
def test_a_task_no_node_can_hold_is_refused_before_any_work(
    gate: Path, tmp_path: Path, resources: str, message: str
) -> None:
    text = RECIPE.replace(
        "{name: base, steps: []}", f"{{name: base, steps: [], resources: {resources}}}"
    )
    with pytest.raises(ExecutorError) as raised:
        _ray(tmp_path, "big", text)
    assert message in str(raised.value) and "lower the recipe's resources" in str(raised.value)
    assert not (tmp_path / "big" / "variants").exists()


def _wait(predicate: Callable[[], Any], what: str, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return found


def _waiting(gate: Path, hash_: str, other_than: frozenset[int] = frozenset()) -> int | None:
    pids = {int(p.name.rsplit("-", 1)[1]) for p in gate.glob(f"{hash_}.waiting-*")}
    return next(iter(pids - set(other_than)), None)


def _hash(tmp_path: Path, text: str, variant: str) -> str:
    from workbench.base_model import base_fingerprint
    from workbench.recipe import load_recipe
    from workbench.task_graph import chain

    path = tmp_path / "hash.yaml"
    path.write_text(text)
    recipe, base = load_recipe(path)
    v = next(v for v in recipe.variants if v.name == variant)
    return chain(v, base_fingerprint(base), recipe.seed)[-1].hash


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


ONE = "name: one\nbase: demo-tiny\ndevice: cpu\nvariants:\n  - {name: base, steps: []}\n"


def test_a_worker_killed_before_its_manifest_is_retried_and_its_leftover_removed(
    gate: Path, tmp_path: Path
) -> None:
    hash_ = _hash(tmp_path, ONE, "base")
    (gate / f"{hash_}.hold").write_text("")
    outcome: dict[str, Any] = {}
    driver = threading.Thread(target=lambda: outcome.update(r=_ray(tmp_path, "one", ONE)))
    driver.start()
    try:
        first = _wait(lambda: _waiting(gate, hash_), "the first attempt at the gate")
        variants = tmp_path / "one" / "variants"
        assert [p.name.split("-")[1] for p in variants.glob(".base.tmp-*")] == [str(first)]
        os.kill(first, signal.SIGKILL)
        second = _wait(
            lambda: _waiting(gate, hash_, frozenset({first})), "the retried attempt at the gate"
        )
        # the retry removed the killed attempt's temporary dir before writing its own
        assert [p.name.split("-")[1] for p in variants.glob(".base.tmp-*")] == [str(second)]
        assert not (variants / "base").exists()
    finally:
        (gate / f"{hash_}.hold").unlink()
        driver.join(timeout=300)
    result, lines = outcome["r"]
    assert result.built == ["base"]
    manifest = json.loads((variants / "base" / MANIFEST).read_text())
    assert verify_files(variants / "base", manifest["files"]) is None
    assert [p.name for p in variants.iterdir()] == ["base"]
    assert any(line.startswith("retried") and "(attempt 2)" in line for line in lines), lines


_DRIVER = """
import sys
from workbench.cli import main
sys.exit(main(["run", sys.argv[1], "--executor", "ray", "--address", sys.argv[2],
               "--storage", sys.argv[3]]))
"""
TWO = ONE + "  - {name: int8, steps: [{quantize: {method: bnb-int8}}]}\n"


def test_a_killed_driver_rerun_reuses_what_was_committed(gate: Path, tmp_path: Path) -> None:
    hash_ = _hash(tmp_path, TWO, "int8")
    (gate / f"{hash_}.hold").write_text("")
    (tmp_path / "two.yaml").write_text(TWO)
    work = tmp_path / "two"
    address = ray.get_runtime_context().gcs_address
    child = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(tmp_path / "two.yaml"), address, str(work)],
        cwd=tmp_path,
    )
    try:
        worker = _wait(lambda: _waiting(gate, hash_), "int8's build at the gate")
        _wait(lambda: (work / "variants" / "base" / MANIFEST).is_file(), "base committed")
        base_created = json.loads((work / "variants" / "base" / MANIFEST).read_text())["created"]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    _wait(lambda: not _alive(worker), "Ray to end the dead driver's task", timeout=120)
    (gate / f"{hash_}.hold").unlink()
    result, lines = _ray(tmp_path, "two", TWO)
    assert (result.reused, result.built) == (["base"], ["int8"])
    assert (
        json.loads((work / "variants" / "base" / MANIFEST).read_text())["created"] == base_created
    )
    assert not any("build base" in line for line in lines)  # committed: not run again
    assert sorted(p.name for p in (work / "variants").iterdir()) == ["base", "int8"]


def test_progress_lines_name_state_and_task() -> None:
    from workbench.resources import Shape
    from workbench.task_graph import Node

    node = Node("h", "build", "build int8 (quantize)", Shape(1.0, 0.0, 2**30))
    assert describe(TaskEvent(node, "queued")) == "queued   build int8 (quantize) [1 CPU, 1.0 GiB]"
    retried = describe(TaskEvent(node, "retried", "vm [10.0.0.2]", 2))
    assert retried == "retried  build int8 (quantize) on vm [10.0.0.2] (attempt 2)"


def _threads(node: Any, inputs: dict) -> int:
    import torch

    return torch.get_num_threads()


def test_a_task_computes_on_as_many_threads_as_it_holds_cpus(gate: Path, tmp_path: Path) -> None:
    from workbench.ray_executor import _run_task
    from workbench.resources import Shape
    from workbench.task_graph import Node
    from workbench.task_status import TaskStatus

    task = ray.remote(_run_task)
    found = {}
    for cpus in (2.0, 1.0, 0.5, 2.0):  # a reused worker takes each task's count anew
        node = Node(f"t{cpus}", "build", "threads", Shape(cpus, 0.0, 0))
        found[cpus] = ray.get(
            task.options(num_cpus=cpus).remote(_threads, node, TaskStatus(str(tmp_path)))
        )
    assert found == {2.0: 2, 1.0: 1, 0.5: 1}


def test_the_cluster_listens_on_loopback_only(gate: Path) -> None:
    import psutil

    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    listening = [
        (p.name(), c.laddr.ip)
        for p in psutil.Process().children(recursive=True)
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert any(name in ("gcs_server", "raylet") for name, _ in listening)
    exposed = [(n, ip) for n, ip in listening if ip not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert exposed == []

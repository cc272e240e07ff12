"""The task graph on a Ray cluster: each node one Ray task, with its resource shape.

Model: the driver submits every node at once, in graph order, each with its dependencies'
object refs as arguments, so Ray starts a task as soon as its inputs exist and a node can hold
it (`num_cpus`, `num_gpus`, `memory`, `accelerator_type`, and the node's one
`workbench_load_slot` for the serving measurements). A task whose worker or node dies is
started again (`max_retries`; a task that raises is not: its error ends the run). A GPU task
runs in a process of its own that exits afterwards (`max_calls=1`), so its GPU memory is freed
before the next. Tasks return `ArtifactRef`s and small records; weights stay on the shared
storage. A task computes on as many threads as it holds CPUs. Each attempt writes
`<work dir>/.tasks/<run>/<node>.json` (attempt, machine) when it starts, which the driver reads
for its progress lines. Usage statistics are off.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.executor import Events, ExecutorError, TaskEvent, TaskFailed, Tasks, TaskState
from workbench.recipe import Recipe
from workbench.remote_store import RemoteStore
from workbench.resources import LOAD_SLOT, Shape
from workbench.storage import StorageError, check_writable
from workbench.task_graph import Node
from workbench.task_status import TaskStatus

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
STATUS_DIR = ".tasks"
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0 before Ray is imported, Ray binds and advertises 127.0.0.1 only (its single-machine
mode): a Ray instance this run starts for itself listens on no network interface."""


def loopback_only() -> None:
    """Make the Ray instance this process will start listen on loopback only; a no-op once Ray
    is imported (its constants are read then)."""
    if "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")


def _connect(address: str | None) -> None:
    """Join the cluster at `address` (`auto`: the one this machine is part of; None: RAY_ADDRESS
    when `ray job submit` set it, else a Ray instance started for this run)."""
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        loopback_only()
    import ray

    if ray.is_initialized():
        return
    if address != "local" and not address.startswith("ray://"):
        _reachable(_bootstrap(address))
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ExecutorError(
            f"--address {address}: no Ray cluster to join ({str(e).splitlines()[0]}); start one "
            f"with `ray start --head`, or leave --address out to start Ray on this machine"
        ) from None


def _bootstrap(address: str) -> str:
    """host:port of the GCS that `address` names (`auto`: the cluster this machine last
    joined, as `ray start` recorded it)."""
    if address != "auto":
        return address
    from ray._private.services import find_bootstrap_address

    found = find_bootstrap_address(None)
    if not found:
        raise ExecutorError(
            "--address auto: this machine is part of no Ray cluster; start one with "
            "`ray start --head`, or pass the head's host:port"
        )
    return str(found)


def _reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or address, int(port or 6379)), timeout=5):
            pass
    except (OSError, ValueError) as e:
        raise ExecutorError(
            f"--address {address}: cannot reach a Ray head there ({e}); pass the address "
            f"`ray start --head` printed (host:port, default port 6379), or `auto` on a node "
            f"of the cluster"
        ) from None


def _probe(path: str, token: str) -> str:
    """On one node: the probe file's content as this node reads it, after writing its own."""
    probe = Path(path) / f".probe-{token}"
    seen = probe.read_text() if probe.is_file() else ""
    (Path(path) / f".probe-{token}-{socket.gethostname()}-{os.getpid()}").write_text(seen)
    return seen


def _on_every_node(function: Any, *args: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """The cluster's alive nodes, and for each the ref of `function(*args)` run there (no CPU
    held, no retry)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(function)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(*args)
        for n in nodes
    ]
    return nodes, refs


def check_shared(work_dir: Path) -> None:
    """Every node of the cluster sees the file this driver writes into `work_dir` and can
    write there; else StorageError naming the nodes that cannot."""
    check_writable(work_dir)
    token = uuid.uuid4().hex[:12]
    (work_dir / f".probe-{token}").write_text(token)
    nodes, refs = _on_every_node(_probe, str(work_dir), token)
    try:
        seen = [_probed(ref, token) for ref in refs]
    finally:
        for p in work_dir.glob(f".probe-{token}*"):
            p.unlink(missing_ok=True)
    blind = [n["NodeManagerAddress"] for n, s in zip(nodes, seen) if s != token]
    if blind:
        raise StorageError(
            f"--storage {work_dir}: not shared: node(s) {', '.join(blind)} cannot see or "
            f"write what this driver wrote there; pass a dir every node mounts at the same "
            f"path (NFS, Lustre, a cloud bucket mounted with s3fs/gcsfuse)"
        )


def _probed(ref: Any, token: str) -> str:
    """What one node's probe read; `token` for a node that left the cluster since it was listed
    (the GCS lists a lost node as alive until its health checks time out)."""
    import ray

    try:
        return str(ray.get(ref, timeout=120))
    except ray.exceptions.TaskUnschedulableError:
        return token
    except Exception as e:  # an OSError on the node arrives wrapped in Ray's task error
        return f"error: {str(e).strip().splitlines()[-1]}"


def _reach(store: RemoteStore) -> str:
    """On one node: '' when it can write and read the store's URL and make its mirror, else why."""
    try:
        store.check()
    except StorageError as e:
        return str(e)
    return ""


def check_reachable(store: RemoteStore) -> None:
    """Every node of the cluster can write the store's URL and make the mirror; else
    StorageError naming the nodes that cannot and why (the driver checked it already:
    `RemoteStore.at`)."""
    nodes, refs = _on_every_node(_reach, store)
    problems = [
        f"{n['NodeManagerAddress']}: {why}"
        for n, ref in zip(nodes, refs)
        if (why := _probed(ref, ""))
    ]
    if problems:
        raise StorageError("; ".join(problems))


@dataclass
class RayExecutor:
    address: str | None = None
    max_retries: int = 3
    """Attempts after the first when a task's worker or node dies."""
    poll_s: float = 0.5
    work_dir: Path | None = None
    """The run's storage, once `prepare` checked it."""

    store: RemoteStore | None = None

    def prepare(self, recipe: Recipe, work_dir: Path, store: RemoteStore | None = None) -> bool:
        """Join the cluster and check the storage (a shared dir, or a URL every node can
        write), before any work; whether it has GPUs."""
        import ray

        _connect(self.address)
        if store is not None:
            check_reachable(store)
        else:
            check_shared(work_dir.absolute())
        self.work_dir, self.store = work_dir.absolute(), store
        return ray.cluster_resources().get("GPU", 0) > 0

    def run(
        self, todo: list[Node], done: dict[str, Any], tasks: Tasks, events: Events
    ) -> dict[str, Any]:
        import ray

        _connect(self.address)
        _check_feasible(todo, [n for n in ray.nodes() if n["Alive"]])
        assert self.work_dir is not None, "prepare() checks the storage first"
        run_id = uuid.uuid4().hex[:12]
        status = TaskStatus(
            f"{self.store.url}/{STATUS_DIR}/{run_id}"
            if self.store
            else str(self.work_dir / STATUS_DIR / run_id)
        )
        try:
            return self._run(todo, done, tasks, events, status)
        finally:
            status.remove()

    def _run(
        self,
        todo: list[Node],
        done: dict[str, Any],
        tasks: Tasks,
        events: Events,
        status: TaskStatus,
    ) -> dict[str, Any]:
        import ray

        cpu_task, gpu_task = ray.remote(_run_task), ray.remote(max_calls=1)(_run_task)
        refs: dict[str, Any] = {}
        for node in todo:
            inputs = [refs.get(k, done.get(k)) for k in node.deps]
            remote = gpu_task if node.shape.gpus else cpu_task
            options = _options(node.shape, self.max_retries, node.label)
            refs[node.key] = remote.options(**options).remote(tasks, node, status, *inputs)
            events(TaskEvent(node, "queued"))
        by_ref = {ref: node for node, ref in zip(todo, refs.values())}
        results, seen = dict(done), dict[str, tuple[int, str | None]]()
        pending = list(by_ref)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=self.poll_s)
            _announce(todo, status, seen, events)
            for ref in ready:
                node = by_ref[ref]
                try:
                    results[node.key] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    for other in pending:
                        ray.cancel(other, force=True)
                    raise TaskFailed(f"{node.label}: {_cause(e)}") from e
                _announce(todo, status, seen, events)
                events(TaskEvent(node, "done", seen.get(node.key, (0, None))[1]))
        return results


def _options(shape: Shape, max_retries: int, name: str) -> dict[str, Any]:
    options: dict[str, Any] = {
        "num_cpus": shape.cpus,
        "num_gpus": shape.gpus,
        "max_retries": max_retries,
        "retry_exceptions": False,
        "name": name,
    }
    if shape.memory:
        options["memory"] = shape.memory
    if shape.accelerator_type:
        options["accelerator_type"] = shape.accelerator_type
    if shape.load_slot:
        options["resources"] = {LOAD_SLOT: 1}
    return options


def _needs(shape: Shape) -> dict[str, float]:
    needs = {"CPU": shape.cpus, "GPU": shape.gpus, "memory": float(shape.memory)}
    if shape.load_slot:
        needs[LOAD_SLOT] = 1
    if shape.accelerator_type:
        needs[f"accelerator_type:{shape.accelerator_type}"] = 0.001
    return {k: v for k, v in needs.items() if v}


def _check_feasible(todo: Sequence[Node], nodes: list[dict[str, Any]]) -> None:
    """Every task fits on some node of the cluster as it is now; else ExecutorError listing
    what asks for more than any node has (Ray would wait for such a node forever)."""
    problems = []
    for node in todo:
        needs = _needs(node.shape)
        if not any(all(n["Resources"].get(k, 0) >= v for k, v in needs.items()) for n in nodes):
            asked = ", ".join(f"{k} {v:g}" for k, v in needs.items())
            problems.append(f"{node.label} asks for {asked}")
    if problems:
        largest = max(nodes, key=lambda n: n["Resources"].get("CPU", 0))["Resources"]
        has = ", ".join(f"{k} {v:g}" for k, v in sorted(largest.items()) if "node:" not in k)
        slot = (
            f"; start each node with --resources '{{\"{LOAD_SLOT}\": 1}}'"
            if any(LOAD_SLOT in p for p in problems)
            else ""
        )
        raise ExecutorError(
            "no node of the cluster can run: " + "; ".join(problems) + f" (the largest node has "
            f"{has}){slot}; lower the recipe's resources: or add a node that has them"
        )


def _cause(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__


def _run_task(tasks: Tasks, node: Node, status: TaskStatus, *inputs: Any) -> Any:
    """One attempt at `node` on a worker: record the attempt, then run it."""
    previous = status.read(node.key) or {"attempt": 0}
    status.write(
        node.key, {"attempt": previous["attempt"] + 1, "where": _where(), "pid": os.getpid()}
    )
    _use_cpus(node.shape.cpus)
    return tasks(node, dict(zip(node.deps, inputs)))


def _use_cpus(cpus: float) -> None:
    """Torch's intra-op threads set to the task's CPUs (at least one). Ray reuses a worker
    process across tasks, and the thread count its first task's OMP_NUM_THREADS fixed would
    otherwise oversubscribe the node when tasks of one CPU each run side by side."""
    import torch

    torch.set_num_threads(max(1, int(cpus)))


def _where() -> str:
    import ray

    from workbench.run_tasks import machine

    return f"{machine()} [{ray.util.get_node_ip_address()}]"


def _announce(
    todo: list[Node], status: TaskStatus, seen: dict[str, tuple[int, str | None]], events: Events
) -> None:
    """A running or retried event for each attempt that started since the last look."""
    for node in todo:
        record = status.read(node.key)
        if record is None:
            continue
        attempt = int(record["attempt"])
        if seen.get(node.key, (0, None))[0] < attempt:
            seen[node.key] = (attempt, record["where"])
            state: TaskState = "running" if attempt == 1 else "retried"
            events(TaskEvent(node, state, record["where"], attempt))

"""Executors run a task graph's nodes: in this process one after another (`LocalExecutor`, the
default), or as Ray tasks over a cluster (`workbench.ray_executor.RayExecutor`).

Contract: `run(todo, done, tasks, events)` calls `tasks(node, inputs)` for every node of `todo`
(in an order where each node's dependencies came first; `inputs` holds their results by key,
from `done` or from this run) and returns every result by key, `done` included. `events` hears
each task's state: queued, running, retried (its attempt died: a worker or node was lost, and
the executor started it again), done. A task that raises ends the run with its error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from workbench.task_graph import Node


class ExecutorError(RuntimeError):
    """The executor cannot run this graph as asked (no cluster at the address, a task no node
    can hold, storage some node cannot see); raised before any task starts."""


class TaskFailed(RuntimeError):
    """A task raised: the run stops, and what was committed stays for the rerun."""


TaskState = Literal["queued", "running", "retried", "done"]


@dataclass(frozen=True)
class TaskEvent:
    node: Node
    state: TaskState
    where: str | None = None
    """The machine (and GPU) it runs on, when known."""
    attempt: int = 1


Events = Callable[[TaskEvent], None]


class Tasks(Protocol):
    """What runs one node (`workbench.run_tasks.RunTasks`); picklable for the Ray executor."""

    def __call__(self, node: Node, inputs: dict[str, Any]) -> Any: ...


class Executor(Protocol):
    def run(
        self, todo: list[Node], done: dict[str, Any], tasks: Tasks, events: Events
    ) -> dict[str, Any]: ...


class LocalExecutor:
    """Today's behaviour: every node in this process, in graph order; no Ray import."""

    def run(
        self, todo: list[Node], done: dict[str, Any], tasks: Tasks, events: Events
    ) -> dict[str, Any]:
        results = dict(done)
        for node in todo:
            events(TaskEvent(node, "queued"))
        for node in todo:
            events(TaskEvent(node, "running", "this machine"))
            results[node.key] = tasks(node, {k: results[k] for k in node.deps})
            events(TaskEvent(node, "done", "this machine"))
        return results


def describe(event: TaskEvent) -> str:
    """A progress line: `running  build int8 (quantize) on 10.0.0.2 [1 CPU, 0.5 GiB]`."""
    where = f" on {event.where}" if event.where else ""
    again = f" (attempt {event.attempt})" if event.attempt > 1 else ""
    shape = f" [{event.node.shape.label}]" if event.state == "queued" else ""
    return f"{event.state:<8} {event.node.label}{where}{again}{shape}"

"""A recipe's run as a graph of tasks: build steps keyed by their chain hash, measurements by
variant and kind, the report last.

Model: a step's output is named by a hash chain, `h_i = sha(h_{i-1}, step name, params, seed)`,
so variants with a common prefix share its nodes, and each hash is built once per run. A
variant's final artifact lives in `variants/<name>/`, the outputs of its earlier steps in
`artifacts/<hash>/`; a hash is built where it is first needed, and every other dir that holds it
(a twin's final dir: same steps, other `serve:`; a shared step's output that another variant
ended with) is a mirror node (hard links). Nodes are kept in insertion order, which is a
topological order and today's sequence: variant by variant, step by step, then each variant's
measurements, the serving measurements, the report. Executors (`workbench.executor`) run the
nodes `plan_work` leaves to do; tasks hand each other `ArtifactRef`s and small records, never
weights.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from compress import StepParams
from workbench.recipe import Recipe, Variant
from workbench.resources import Shape, TaskKind, default_shape, resolve, step_kind


def sha(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class StepCall:
    name: str
    params: StepParams
    hash: str


def chain(variant: Variant, base_hash: str, seed: int) -> list[StepCall]:
    calls, parent = [], base_hash
    for name, params in variant.step_calls():
        parent = sha(parent, name, params.model_dump_json(), str(seed))
        calls.append(StepCall(name, params, parent))
    return calls


@dataclass(frozen=True)
class Node:
    key: str
    """A build: its chain hash; a mirror: `mirror:<its dir>`; a measurement: `<kind>:<variant>`
    (`serving` and `report` are one per run)."""
    kind: TaskKind
    label: str
    """What progress lines call it: `build int8 (quantize)`."""
    shape: Shape
    deps: tuple[str, ...] = ()
    variant: str | None = None
    """A build: the variant whose chain (up to `step`) it is and whose name its manifest records;
    a mirror or measurement: its variant."""
    step: int | None = None
    out: str | None = None
    """A build or mirror: its artifact dir, relative to the work dir."""
    reads: tuple[tuple[str, str], ...] = ()
    """A measurement: (variant, key of the node that makes it) for each variant it reads, in
    recipe order."""


@dataclass(frozen=True)
class ArtifactRef:
    """What a build or mirror task hands on: where the committed artifact is, its hash, and the
    sha256 of its manifest (a reader checks it got the artifact that task committed)."""

    hash: str
    path: str
    manifest_digest: str
    status: Literal["built", "reused"]
    problem: str | None = None
    """Why an artifact with this hash was rebuilt instead of reused (its files changed)."""


MEASUREMENT_KINDS = frozenset({"quality", "divergence", "serving", "report"})


@dataclass(frozen=True)
class TaskGraph:
    nodes: dict[str, Node]
    """In insertion order: every node after its dependencies."""
    finals: dict[str, str]
    """Variant name -> the node that makes `variants/<name>/` (a build or a mirror)."""
    hashes: dict[str, str] = field(default_factory=dict)
    """Variant name -> its final chain hash (its manifest's `hash`)."""

    def targets(self) -> list[str]:
        """What the run must produce: every variant, every measurement, the report."""
        measured = [k for k, n in self.nodes.items() if n.kind in MEASUREMENT_KINDS]
        return [*self.finals.values(), *measured]


@dataclass(frozen=True)
class GraphSettings:
    """What the graph's resource shapes depend on beyond the recipe."""

    base_bytes: int
    """The base's weights in float32."""
    gpus: bool
    """The recipe may use GPUs (its device is not `cpu`) and the executor has some."""
    measure: bool = True
    """Add the measurement and report nodes (False: the builds only)."""


def plan(
    recipe: Recipe, variants: list[Variant], base_hash: str, settings: GraphSettings
) -> TaskGraph:
    """The graph of the run of `variants` (a subset of the recipe's, in its order)."""
    nodes: dict[str, Node] = {}
    places: dict[str, str] = {}  # artifact dir -> the key of the node that makes it
    for v in variants:
        calls, parent = chain(v, base_hash, recipe.seed), None
        for i, call in enumerate(calls):
            place = f"variants/{v.name}" if i == len(calls) - 1 else f"artifacts/{call.hash}"
            if place not in places:
                node = _build_node(v, i, call, place, parent, settings)
                if call.hash in nodes:  # built elsewhere: mirrored here
                    node = _mirror_node(v, place, nodes[call.hash])
                nodes[node.key] = node
                places[place] = node.key
            parent = places[place]
    finals = {v.name: places[f"variants/{v.name}"] for v in variants}
    hashes = {v.name: chain(v, base_hash, recipe.seed)[-1].hash for v in variants}
    graph = TaskGraph(nodes, finals, hashes)
    return _with_measurements(recipe, graph, settings) if settings.measure else graph


def _build_node(
    variant: Variant,
    index: int,
    call: StepCall,
    place: str,
    parent: str | None,
    settings: GraphSettings,
) -> Node:
    """The node that builds step `index` of `variant` (`call`) into `place` from `parent` (the
    key of the node that makes its input; None: the base)."""
    kind = step_kind(call.name, getattr(call.params, "method", None))
    return Node(
        key=call.hash,
        kind=kind,
        label=f"build {variant.name} ({call.name})",
        shape=resolve(variant.resources, default_shape(kind, settings.base_bytes, settings.gpus)),
        deps=(parent,) if parent else (),
        variant=variant.name,
        step=index,
        out=place,
    )


def _mirror_node(variant: Variant, place: str, source: Node) -> Node:
    """`source`'s artifact mirrored into `place` (hard links) for `variant`: a twin's final
    dir, or a shared step's output that another variant ended with."""
    return Node(
        key=f"mirror:{place}",
        kind="mirror",
        label=f"mirror {variant.name} (as {source.variant})",
        shape=default_shape("mirror", 0, False),
        deps=(source.key,),
        variant=variant.name,
        out=place,
    )


def _with_measurements(recipe: Recipe, graph: TaskGraph, settings: GraphSettings) -> TaskGraph:
    evals, asked = recipe.evals, recipe.resources
    nodes, finals = dict(graph.nodes), graph.finals

    def shape(kind: TaskKind) -> Shape:
        asked_for = {"quality": asked.quality, "divergence": asked.divergence}
        default = default_shape(kind, settings.base_bytes, settings.gpus)
        return resolve(asked_for.get(kind, asked.load), default)

    def measurement(kind: TaskKind, name: str | None, reads: dict[str, str]) -> None:
        key = f"{kind}:{name}" if name else str(kind)
        label = f"{kind} {name}" if name else "serving (load ramps, chat, server check)"
        deps = tuple(dict.fromkeys(reads.values()))
        nodes[key] = Node(key, kind, label, shape(kind), deps, name, reads=tuple(reads.items()))

    reference = evals.divergence.reference if evals.divergence else None
    for name, final in finals.items():
        if evals.quality:
            measurement("quality", name, {name: final})
        if reference is not None and reference in finals:
            ordered = [n for n in finals if n in (name, reference)]
            measurement("divergence", name, {n: finals[n] for n in ordered})
    if evals.load is not None or evals.chat_prompts:
        measurement("serving", None, dict(finals))
    measured = tuple(k for k in nodes if k not in graph.nodes)
    report_deps = (*finals.values(), *measured)
    nodes["report"] = Node(
        "report", "report", "report", default_shape("report", 0, False), report_deps
    )
    return TaskGraph(nodes, finals, graph.hashes)


def plan_work(
    graph: TaskGraph, committed: Callable[[Node], ArtifactRef | None]
) -> tuple[list[Node], dict[str, ArtifactRef]]:
    """(nodes to run, in graph order; artifacts already committed, by key). From each target
    back along its dependencies, a build or mirror node whose artifact `committed` finds (its
    hash recorded, its files intact) is done, and what only it needed is not run."""
    done: dict[str, ArtifactRef] = {}
    needed: set[str] = set()
    pending = list(reversed(graph.targets()))
    while pending:
        key = pending.pop()
        if key in needed or key in done:
            continue
        node = graph.nodes[key]
        ref = committed(node) if node.out is not None else None
        if ref is not None:
            done[key] = ref
            continue
        needed.add(key)
        pending.extend(reversed(node.deps))
    return [n for k, n in graph.nodes.items() if k in needed], done

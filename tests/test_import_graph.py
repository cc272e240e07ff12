"""The top-level packages import each other without cycles (lazy imports inside functions count:
they are dependencies too). The layers, lowest first: compress; catalog and serve; evals;
reports; workbench."""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("compress", "catalog", "serve", "evals", "reports", "workbench")


def import_graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> 'file: module' of each import."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top in PACKAGES and top != package:
                        graph[package][top].append(f"{path.relative_to(ROOT)}: {module}")
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in graph.get(node, {}):
            if state.get(nxt) == "open":
                return [*trail[trail.index(nxt) :], nxt] if nxt in trail else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*trail, nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in list(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_top_level_packages_have_no_import_cycle() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle:
        hops = [f"{a} -> {b} ({graph[a][b][0]})" for a, b in itertools.pairwise(cycle)]
        raise AssertionError("import cycle between packages:\n  " + "\n  ".join(hops))


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b": ["x"]}, "b": {"c": ["y"]}, "c": {"a": ["z"]}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": ["x"]}, "b": {}}) is None


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, lazily or not (relative imports do not occur here)."""
    tree = ast.parse(path.read_text())
    return {
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }


SERVE_LAYERS = {  # a layer imports only the layers listed before it
    "core": set(),
    "lora": {"core"},
    "model": {"core", "lora"},
    "engine": {"core", "lora", "model"},
    "http": {"core", "lora", "model", "engine"},
}


def test_serve_layers_import_only_downwards() -> None:
    """serve.core <- serve.model <- serve.engine <- serve.http; nothing below the HTTP server
    imports it or FastAPI / Starlette / uvicorn."""
    for layer, allowed in SERVE_LAYERS.items():
        for path in sorted((ROOT / "serve" / layer).glob("*.py")):
            imported = _imports(path)
            web = {m for m in imported if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}
            assert layer == "http" or not web, f"{path}: {web}"
            inner = {m.split(".")[1] for m in imported if m.startswith("serve.")}
            assert inner <= allowed | {layer}, f"{path} imports serve.{inner - allowed - {layer}}"


def test_the_engine_core_loads_without_torch() -> None:
    """The engine core's bookkeeping (every module of serve.core) is pure Python: importing it
    loads no torch, transformers or FastAPI (a fresh interpreter, since this one has torch
    loaded already)."""
    import subprocess
    import sys

    probe = (
        "import sys, pkgutil, importlib, serve.core as core; "
        "[importlib.import_module(f'serve.core.{m.name}') for m in pkgutil.iter_modules(core.__path__)]; "
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_the_http_server_reaches_the_engine_only_through_async_engine() -> None:
    """No route or helper of serve/http reads the `LLMEngine` behind `AsyncEngine`
    (`x.engine.engine`): its tokenizer, configs and adapter table belong to the engine thread;
    the server reads `AsyncEngine`'s own copies and snapshots."""
    for path in sorted((ROOT / "serve" / "http").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "engine":
                inner = node.value
                reached = (isinstance(inner, ast.Name) and inner.id == "engine") or (
                    isinstance(inner, ast.Attribute) and inner.attr == "engine"
                )
                assert not reached, f"{path}:{node.lineno} reaches the LLMEngine"


LAYERED = (*PACKAGES, "benchmarks")


def module_graph() -> dict[str, set[str]]:
    """module -> the modules of LAYERED it imports, lazily, under TYPE_CHECKING or not. `from
    pkg import sub` of a submodule depends on `pkg.sub` alone (the package's `__init__` runs
    either way: it is no edge of its own)."""
    files = {}
    for package in LAYERED:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                whole = len(subs) == len(node.names)
                found |= subs | ({node.module} & files.keys() if not whole else set())
        graph[name] = found - {name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's cycles as its strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_files_import_each_other_even_lazily() -> None:
    graph = module_graph()
    cycles = strongly_connected(graph)
    assert cycles == [], "files in an import cycle (break it by moving what both need down):\n" + (
        "\n".join(
            "  " + ", ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles
        )
    )


def test_the_file_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_benchmarks_are_the_top_layer_that_no_package_imports() -> None:
    upward = sorted(
        f"{m} imports {d}"
        for m, deps in module_graph().items()
        if not m.startswith("benchmarks")
        for d in deps
        if d.split(".")[0] == "benchmarks"
    )
    assert upward == []

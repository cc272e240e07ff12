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


def test_the_engine_core_does_not_import_the_http_server() -> None:
    engine_core = ("engine", "scheduler", "block_pool", "kv_cache_manager", "model_runner")
    for name in engine_core:
        tree = ast.parse((ROOT / "serve" / f"{name}.py").read_text())
        imported = {
            alias.name if isinstance(node, ast.Import) else node.module or ""
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        assert not {m for m in imported if m.split(".")[0] in ("fastapi", "starlette", "uvicorn")}


def test_the_scheduler_and_kv_blocks_load_without_torch() -> None:
    """The engine core's bookkeeping is pure Python: importing it loads no torch (a fresh
    interpreter, since this one has torch loaded already)."""
    import subprocess
    import sys

    probe = (
        "import sys, serve.block_pool, serve.kv_cache_manager, serve.scheduler, serve.request; "
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"

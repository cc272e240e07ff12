"""The executor benchmark's logic: its workloads are valid recipes of the intended shape, and the
ratios are summarized per round."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.executor_bench import TOY, Ratio, independent_recipe, ratio
from workbench.recipe import load_recipe
from workbench.task_graph import GraphSettings, plan


def test_independent_variants_share_no_node_and_ask_one_cpu(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(independent_recipe(4))
    recipe, _ = load_recipe(path)
    graph = plan(recipe, recipe.variants, "base", GraphSettings(2**20, gpus=False, measure=False))
    assert [n.kind for n in graph.nodes.values()] == ["train"] * 4
    assert all(n.deps == () and n.shape.cpus == 1.0 for n in graph.nodes.values())


def test_the_toy_workload_is_a_valid_recipe(tmp_path: Path) -> None:
    path = tmp_path / "toy.yaml"
    path.write_text(TOY)
    recipe, _ = load_recipe(path)
    assert [v.name for v in recipe.variants] == ["base", "int8", "nf4", "shop-lora"]


def test_ratios_are_ray_over_local_per_round() -> None:
    found = ratio([(10.0, 12.0), (10.0, 11.0), (20.0, 30.0)])
    assert found == Ratio(median=1.2, low=1.1, high=1.5)
    assert found.line("toy", 1.3).endswith("meets the target x1.30")
    assert ratio([(10.0, 7.0)]).line("four", 0.65).endswith("misses the target x0.65")
    with pytest.raises(ZeroDivisionError):
        ratio([(0.0, 1.0)])

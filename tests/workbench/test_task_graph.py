"""The task graph of a recipe: nodes keyed by chain hash, shared prefixes built once, graph order,
resource shapes, and the nodes left to run when some artifacts are committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from workbench.recipe import load_recipe
from workbench.resources import MIN_MEMORY, Shape, default_shape
from workbench.task_graph import ArtifactRef, GraphSettings, Node, chain, plan, plan_work

RECIPE = """\
name: graph
base: demo-tiny
variants:
  - {name: base, steps: []}
  - {name: twice, steps: [{identity: {}}, {identity: {}}]}
  - {name: int8, steps: [{quantize: {method: int8-wo}}]}
  - {name: int8-kv8, steps: [{quantize: {method: int8-wo}}], serve: {kv_cache_dtype: int8}}
  - name: int8-lora
    steps: [{quantize: {method: int8-wo}}, {lora: {rank: 4, data: shift, steps: 2}}]
    resources: {gpus: 2, memory: 3GiB, accelerator_type: H100}
evals:
  quality: [corpus_ppl]
  divergence: {reference: base}
  load: {concurrency: [1], prompt_len: [16], max_tokens: 4}
resources:
  quality: {cpus: 2}
"""
GIB = 2**30


def _graph(tmp_path: Path, text: str = RECIPE, gpus: bool = False, measure: bool = True):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    recipe, _ = load_recipe(path)
    settings = GraphSettings(base_bytes=GIB, gpus=gpus, measure=measure)
    return recipe, plan(recipe, recipe.variants, "basehash", settings)


def test_shared_prefixes_build_once_and_other_dirs_are_mirrors(tmp_path: Path) -> None:
    recipe, graph = _graph(tmp_path, measure=False)
    hashes = {v.name: [c.hash for c in chain(v, "basehash", 0)] for v in recipe.variants}
    builds = {k: n for k, n in graph.nodes.items() if n.kind != "mirror"}
    # base's identity hash is twice's first step: built once, into base's dir, and mirrored
    # into artifacts/ for twice; the int8 quantization is built once for three variants
    assert hashes["base"][0] == hashes["twice"][0]
    assert set(builds) == {
        *hashes["base"],
        hashes["twice"][1],
        hashes["int8"][0],
        hashes["int8-lora"][1],
    }
    assert builds[hashes["base"][0]].out == "variants/base"
    assert builds[hashes["int8"][0]].out == "variants/int8"
    mirrors = {n.out: n.deps for n in graph.nodes.values() if n.kind == "mirror"}
    assert mirrors == {
        f"artifacts/{hashes['base'][0]}": (hashes["base"][0],),
        "variants/int8-kv8": (hashes["int8"][0],),
        f"artifacts/{hashes['int8'][0]}": (hashes["int8"][0],),
    }
    lora = builds[hashes["int8-lora"][1]]
    assert lora.deps == (f"mirror:artifacts/{hashes['int8'][0]}",) and lora.step == 1
    assert graph.finals["int8-kv8"] == "mirror:variants/int8-kv8"
    assert graph.hashes["int8-kv8"] == hashes["int8"][0]


def test_nodes_come_after_their_dependencies_in_recipe_order(tmp_path: Path) -> None:
    _, graph = _graph(tmp_path)
    keys = list(graph.nodes)
    for i, node in enumerate(graph.nodes.values()):
        assert all(keys.index(d) < i for d in node.deps), node.key
    kinds = [n.kind for n in graph.nodes.values()]
    assert kinds[-2:] == ["serving", "report"]
    labels = [n.label for n in graph.nodes.values() if n.kind in ("quality", "divergence")]
    assert labels[:4] == ["quality base", "divergence base", "quality twice", "divergence twice"]
    div = graph.nodes["divergence:twice"]
    assert div.reads == (("base", graph.finals["base"]), ("twice", graph.finals["twice"]))
    assert graph.nodes["serving"].reads == tuple(graph.finals.items())
    measured = [k for k, n in graph.nodes.items() if n.kind in ("quality", "divergence", "serving")]
    assert graph.nodes["report"].deps == (*graph.finals.values(), *measured)


def test_resource_defaults_follow_the_base_size_and_the_step_kind(tmp_path: Path) -> None:
    assert default_shape("build", GIB, gpus=True) == Shape(1.0, 0.0, 2 * GIB)
    assert default_shape("train", GIB, gpus=True) == Shape(1.0, 1.0, 4 * GIB)
    assert default_shape("train", GIB, gpus=False) == Shape(1.0, 0.0, 4 * GIB)
    assert default_shape("calibrate", 1000, gpus=True) == Shape(1.0, 1.0, MIN_MEMORY)
    serving = default_shape("serving", GIB, gpus=True)
    assert serving == Shape(2.0, 1.0, 2 * GIB, load_slot=True)
    _recipe, graph = _graph(tmp_path, gpus=True)
    lora = next(n for n in graph.nodes.values() if n.label == "build int8-lora (lora)")
    assert lora.kind == "train" and lora.shape == Shape(1.0, 2.0, 3 * GIB, "H100")
    assert graph.nodes["quality:base"].shape == Shape(2.0, 1.0, int(1.5 * GIB))
    assert graph.nodes["serving"].shape.load_slot


def _ref(node: Node) -> ArtifactRef:
    return ArtifactRef(node.key, f"/w/{node.out}", "digest", "reused")


def test_committed_nodes_are_skipped_with_what_only_they_needed(tmp_path: Path) -> None:
    _recipe, graph = _graph(tmp_path, measure=False)
    todo, done = plan_work(graph, lambda node: None)
    assert [n.key for n in todo] == list(graph.nodes) and done == {}
    # twice committed: its first step's mirror is not needed; int8 committed: the int8-kv8
    # mirror reads it as is
    committed = {"variants/twice", "variants/int8"}
    todo, done = plan_work(graph, lambda n: _ref(n) if n.out in committed else None)
    assert {n.out for n in todo} == {
        "variants/base",
        "variants/int8-kv8",
        f"artifacts/{graph.hashes['int8']}",
        "variants/int8-lora",
    }
    assert set(done) == {graph.finals["twice"], graph.finals["int8"]}
    every = plan_work(graph, _ref)
    assert every[0] == [] and set(every[1]) == set(graph.finals.values())


def test_resources_and_storage_change_no_hash(tmp_path: Path) -> None:
    from workbench.pipeline import recipe_hash

    plain = RECIPE.replace("    resources: {gpus: 2, memory: 3GiB, accelerator_type: H100}\n", "")
    plain = plain.replace("resources:\n  quality: {cpus: 2}\n", "")
    first, _ = _graph(tmp_path, RECIPE)
    second, _ = _graph(tmp_path, plain + "storage: /mnt/shared/graph\n")
    assert recipe_hash(first) == recipe_hash(second)


@pytest.mark.parametrize(
    ("where", "text", "expected"),
    [
        (
            "unknown resource key",
            "    resources: {gpu: 1}\n",
            "variants[4].resources.gpu",
        ),
        ("bad memory", "    resources: {memory: lots}\n", "variants[4].resources.memory"),
        ("negative gpus", "    resources: {gpus: -1}\n", "variants[4].resources.gpus"),
    ],
)
def test_bad_resources_name_the_field(tmp_path: Path, where: str, text: str, expected: str) -> None:
    from workbench.recipe_errors import RecipeError

    path = tmp_path / "recipe.yaml"
    path.write_text(
        RECIPE.replace("    resources: {gpus: 2, memory: 3GiB, accelerator_type: H100}\n", text)
    )
    with pytest.raises(RecipeError) as raised:
        load_recipe(path)
    assert str(path) in str(raised.value) and expected in str(raised.value), where


def test_unknown_eval_resource_key_names_what_is_allowed(tmp_path: Path) -> None:
    from workbench.recipe_errors import RecipeError

    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE.replace("  quality: {cpus: 2}", "  lm_eval: {cpus: 2}"))
    with pytest.raises(RecipeError) as raised:
        load_recipe(path)
    message = str(raised.value)
    assert "resources.lm_eval" in message and "quality" in message and "load" in message

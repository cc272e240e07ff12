"""Distillation's layer choice and cheaper KD: block influence against a direct computation, the
kept layers by importance, an explicit list honoured exactly, the removal-only student equal to
the teacher's kept layers, and the cached top-k KL against the full KL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

import compress.kd_loss
from compress.kd_loss import TopK, TopKCache, full_kl, kd_and_ce, top_k_kl
from compress.layer_importance import block_influence, most_influential
from workbench.pipeline import Pipeline
from workbench.recipe import RecipeError, load_recipe


def _llama(layers: int = 4, vocab: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def test_block_influence_equals_one_minus_the_cosine_of_hidden_states() -> None:
    model = _llama()
    rows = torch.randint(0, 64, (5, 12), generator=torch.Generator().manual_seed(1))
    scores = block_influence(model, rows, batch_size=2)
    model.model.norm = torch.nn.Identity()  # so the last hidden state is the last layer's output
    with torch.no_grad():
        hidden = model(rows, output_hidden_states=True).hidden_states
    direct = [
        float((1 - torch.cosine_similarity(hidden[i], hidden[i + 1], dim=-1)).mean())
        for i in range(4)
    ]
    assert scores == pytest.approx(direct, abs=1e-6)
    assert len(set(scores)) == 4


def test_the_most_influential_layers_are_kept_in_order() -> None:
    assert most_influential([0.1, 0.5, 0.2, 0.5, 0.05], 3) == [1, 2, 3]
    assert most_influential([0.3, 0.3, 0.3], 2) == [0, 1]  # ties: the earlier layer


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_top_k_kl_over_the_whole_vocabulary_is_the_full_kl(temperature: float) -> None:
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(2, 7, 50, generator=gen) * 3
    student = (torch.randn(2, 7, 50, generator=gen) * 3).requires_grad_()
    full = full_kl(student, teacher, temperature)
    (full_grad,) = torch.autograd.grad(full, student)
    cached = top_k_kl(student, TopK.of(teacher, 50, temperature), temperature)
    (cached_grad,) = torch.autograd.grad(cached, student)
    assert float(cached) == pytest.approx(float(full), abs=1e-5)
    torch.testing.assert_close(cached_grad, full_grad, rtol=1e-4, atol=1e-6)
    for k in (1, 5, 20):  # merging outcomes into one bucket never raises a KL
        assert float(top_k_kl(student, TopK.of(teacher, k, temperature), temperature)) <= float(
            full
        )


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kd_loss_equals_the_kl_and_cross_entropy_it_blends(
    temperature: float, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Value and gradient against autograd through `full_kl` and `cross_entropy`, over rows
    that span several blocks (the last one partial)."""
    monkeypatch.setattr(compress.kd_loss, "BLOCK_BYTES", 4 * 50 * 4)  # 4 rows a block
    gen = torch.Generator().manual_seed(0)
    teacher = (torch.randn(2, 7, 50, generator=gen) * 3).to(dtype)
    student = (torch.randn(2, 7, 50, generator=gen) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (2, 7), generator=gen)
    alpha = 0.9
    exact = student.detach().float().requires_grad_()  # the reference, in float32
    reference = alpha * temperature**2 * full_kl(exact, teacher, temperature) + (
        1 - alpha
    ) * F.cross_entropy(exact.flatten(0, 1), labels.flatten())
    (reference_grad,) = torch.autograd.grad(reference, exact)
    fused = kd_and_ce(student, teacher, labels, alpha, temperature)
    (fused_grad,) = torch.autograd.grad(2.0 * fused, student)  # an upstream gradient is applied
    assert fused.dtype == torch.float32
    assert float(fused) == pytest.approx(float(reference), rel=1e-5)
    assert fused_grad.dtype == dtype  # rounded once to the logits' dtype
    rtol = 1e-4 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(fused_grad.float(), 2.0 * reference_grad, rtol=rtol, atol=1e-6)


def test_top_k_cache_runs_the_teacher_once_per_window() -> None:
    teacher = _llama(layers=1)
    calls: list[int] = []
    teacher.model.embed_tokens.register_forward_hook(lambda _m, a, _o: calls.append(a[0].shape[0]))
    cache = TopKCache(k=8, temperature=2.0)
    rows = torch.randint(0, 64, (6, 10), generator=torch.Generator().manual_seed(2))
    first = cache.get(teacher, rows[:4])
    again = cache.get(teacher, rows[[3, 0, 5]])  # two cached windows, one new
    assert calls == [4, 1] and (cache.hits, cache.misses) == (2, 5)
    torch.testing.assert_close(again.log_probs[1], first.log_probs[0])
    assert torch.equal(again.ids[0], first.ids[3]) and again.ids.dtype == torch.long
    with torch.no_grad():
        direct = TopK.of(teacher(rows[5:6]).logits[:, :-1], 8, 2.0)
    torch.testing.assert_close(again.log_probs[2], direct.log_probs[0])
    assert first.log_probs.shape == (4, 9, 8) and float(first.rest.min()) >= 0


STUDENTS = """\
name: students
base: demo-tiny
variants:
  - {name: picked, steps: [{distill: {layers: 1, select: importance, importance_windows: 4, seq_len: 64, steps: 0}}]}
  - {name: listed, steps: [{distill: {layers: [1, 0], steps: 0, seq_len: 64}}]}
  - {name: topk, steps: [{distill: {layers: 1, select: importance, importance_windows: 4, kd: {top_k: 16}, steps: 6, batch_size: 4, seq_len: 64, eval_every: 0, checkpoint_every: 0}}]}
"""


@pytest.fixture(scope="module")
def students(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("students")
    (root / "recipe.yaml").write_text(STUDENTS)
    recipe, base = load_recipe(root / "recipe.yaml")
    return {
        r.name: {"path": r.path, **r.manifest.to_json()}
        for r in Pipeline(recipe, base, root / "work").run()
    }


def test_importance_selection_keeps_the_highest_scores_and_records_them(
    students: dict[str, dict], tiny_model_dir: Path
) -> None:
    teacher_layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    info = students["picked"]["info"]
    scores = info["layer_importance"]["scores"]
    assert len(scores) == teacher_layers and info["layer_selection"] == "importance"
    assert info["kept_layers"] == most_influential(scores, 1)
    assert info["layer_importance"]["windows"]["tokens"] == 4 * 64


def test_removal_only_student_is_the_teachers_kept_layers_exactly(
    students: dict[str, dict], tiny_model_dir: Path
) -> None:
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    for name, kept in (("listed", [0, 1]), ("picked", students["picked"]["info"]["kept_layers"])):
        assert students[name]["info"]["kept_layers"] == kept
        assert "final_loss" not in students[name]["info"]  # nothing trained
        student = AutoModelForCausalLM.from_pretrained(students[name]["path"]).state_dict()
        for key, value in student.items():
            source = key
            if key.startswith("model.layers."):
                index = int(key.split(".")[2])
                source = key.replace(f"model.layers.{index}.", f"model.layers.{kept[index]}.", 1)
            assert torch.equal(value, teacher[source]), key


def test_top_k_student_trains_from_its_cache(students: dict[str, dict]) -> None:
    info = students["topk"]["info"]
    assert info["top_k_cache"]["misses"] == info["top_k_cache"]["windows"] > 0
    assert info["top_k_cache"]["hits"] + info["top_k_cache"]["misses"] == 6 * 4
    assert info["final_loss"] < info["first_loss"]


TWINS = """\
name: twins
base: demo-tiny
variants:
  - {name: kd, steps: [{distill: &s {layers: 1, select: importance, importance_windows: 4, seq_len: 64, steps: 2, batch_size: 2, eval_every: 0, checkpoint_every: 0}}]}
  - {name: ce, steps: [{distill: {<<: *s, kd: false}}]}
  - {name: removal, steps: [{distill: {<<: *s, steps: 0}}]}
  - {name: other-windows, steps: [{distill: {<<: *s, steps: 0, importance_windows: 3}}]}
"""


def test_students_of_one_teacher_measure_it_once(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import compress.distill

    calls: dict[str, int] = {"influence": 0, "perplexity": 0}

    def counted(name: str, f):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return f(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(compress.distill, "_TEACHER_MEASURES", {})
    monkeypatch.setattr(compress.distill, "block_influence", counted("influence", block_influence))
    monkeypatch.setattr(
        compress.distill, "perplexity", counted("perplexity", compress.distill.perplexity)
    )
    (tmp_path / "recipe.yaml").write_text(TWINS)
    recipe, base = load_recipe(tmp_path / "recipe.yaml")
    built = {
        r.name: r.manifest.to_json()["info"] for r in Pipeline(recipe, base, tmp_path / "w").run()
    }
    # block influence: once for the three students on 4 windows, once on 3 windows; perplexity:
    # the teacher's once (not once per student), the two trained students' validation at their
    # last step (their final figure, not measured again), the two removal-only students' own
    assert calls == {"influence": 2, "perplexity": 1 + 2 + 2}
    for name in ("kd", "ce"):
        last_step = built[name]["validation_perplexity_by_step"][-1]
        assert built[name]["validation_perplexity"] == last_step[1]
    same = [built[n]["layer_importance"]["scores"] for n in ("kd", "ce", "removal")]
    assert same[0] == same[1] == same[2] != built["other-windows"]["layer_importance"]["scores"]
    assert len({built[n]["teacher_validation_perplexity"] for n in built}) == 1


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_teacher_and_untrained_student_perplexities_run_in_the_training_precision(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    """A trained student is validated under its training's autocast (accelerate's wrapper); the
    teacher's perplexity and a removal-only student's are measured in the same precision, not
    in float32 beside a bfloat16 student."""
    import compress.distill

    seen: list[bool] = []
    measure = compress.distill.perplexity
    monkeypatch.setattr(compress.distill, "_TEACHER_MEASURES", {})
    monkeypatch.setattr(
        compress.distill,
        "perplexity",
        lambda m, rows: seen.append(torch.is_autocast_enabled("cpu")) or measure(m, rows),
    )
    (tmp_path / "recipe.yaml").write_text(
        "name: p\nbase: demo-tiny\nvariants:\n  - {name: removal, steps: [{distill: {layers: 1, "
        f"seq_len: 64, steps: 0, mixed_precision: '{precision}'}}}}]}}\n"
    )
    recipe, base = load_recipe(tmp_path / "recipe.yaml")
    (built,) = Pipeline(recipe, base, tmp_path / "w").run()
    assert seen == [precision == "bf16"] * 2  # the student's, then the teacher's
    info = built.manifest.to_json()["info"]
    assert info["mixed_precision"] == precision
    assert info["validation_perplexity"] > info["teacher_validation_perplexity"] > 1


def test_importance_selection_with_a_layer_list_is_a_recipe_error(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        "name: x\nbase: demo-tiny\nvariants:\n"
        "  - {name: s, steps: [{distill: {layers: [0, 1], select: importance}}]}\n"
    )
    with pytest.raises(RecipeError, match="select: importance chooses the layers"):
        load_recipe(path)


@pytest.mark.parametrize("tied", [True, False])
def test_cast_frozen_linears_rounds_frozen_linears_and_leaves_the_embedding(tied: bool) -> None:
    from compress.training import cast_frozen_linears

    model = _llama(layers=2)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)
    model.model.layers[1].mlp.down_proj.weight.requires_grad_(True)  # trainable: kept
    embedding = model.model.embed_tokens.weight.detach().clone()
    head = model.lm_head.weight.detach().clone()
    cast = cast_frozen_linears(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert cast == sum(m.weight.numel() for m in linears) - 32 * 64  # all but the trainable one
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    assert torch.equal(model.lm_head.weight, head.to(torch.bfloat16))
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float32


def _built_with_and_without_the_cast(
    module: Any, recipe_text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> list[Any]:
    """The recipe's one variant built twice: with `module.cast_frozen_linears` as it is, then with
    it doing nothing (autocast casting every forward); asserts each build called it once."""
    (tmp_path / "recipe.yaml").write_text(recipe_text)
    recipe, base = load_recipe(tmp_path / "recipe.yaml")
    cast = module.cast_frozen_linears
    built = []
    for label, spy in [("cast", cast), ("autocast", lambda model: 0)]:
        calls: list[int] = []
        monkeypatch.setattr(
            module, "cast_frozen_linears", lambda m, s=spy, c=calls: c.append(s(m)) or 0
        )
        monkeypatch.setattr("compress.distill._TEACHER_MEASURES", {})
        (variant,) = Pipeline(recipe, base, tmp_path / label).run()
        assert len(calls) == 1 and (calls[0] > 0) == (label == "cast")
        built.append(variant)
    return built


def test_a_teacher_cast_to_bfloat16_once_trains_the_same_student_as_autocast_casting_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KD under bf16 autocast: the teacher's frozen linears rounded to bfloat16 once before
    training give the same losses, validation figures and student weights, bit for bit, as
    autocast rounding them on every forward."""
    import compress.distill

    recipe = (
        "name: c\nbase: demo-tiny\nvariants:\n  - {name: s, steps: [{distill: {layers: 1, "
        "seq_len: 32, steps: 3, batch_size: 2, eval_every: 2, mixed_precision: bf16}}]}\n"
    )
    runs = [
        (b.manifest.to_json()["info"], AutoModelForCausalLM.from_pretrained(b.path).state_dict())
        for b in _built_with_and_without_the_cast(compress.distill, recipe, tmp_path, monkeypatch)
    ]
    (cast_info, cast_weights), (auto_info, auto_weights) = runs
    for key in ("first_loss", "final_loss", "validation_perplexity_by_step"):
        assert cast_info[key] == auto_info[key], key
    assert cast_info["teacher_validation_perplexity"] == auto_info["teacher_validation_perplexity"]
    assert cast_weights.keys() == auto_weights.keys()
    assert all(torch.equal(cast_weights[k], auto_weights[k]) for k in cast_weights)


@pytest.mark.parametrize("qlora", [False, True])
def test_a_lora_base_cast_to_bfloat16_once_trains_the_same_adapter_as_autocast_casting_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qlora: bool
) -> None:
    """LoRA and QLoRA under bf16 autocast: the frozen base's plain linears (and its head)
    rounded to bfloat16 once give the same losses and adapter weights, bit for bit, as autocast
    rounding them on every forward; a 4-bit base's quantized linears are left alone."""
    from safetensors.torch import load_file

    import compress.lora

    lora = (
        "{lora: {rank: 4, targets: [q_proj, v_proj], seq_len: 32, steps: 3, batch_size: 2, "
        "mixed_precision: bf16}}"
    )
    steps = f"[{{quantize: {{method: bnb-nf4}}}}, {lora}]" if qlora else f"[{lora}]"
    recipe = f"name: l\nbase: demo-tiny\nvariants:\n  - {{name: a, steps: {steps}}}\n"
    runs = [
        (b.manifest.to_json()["info"], load_file(b.path / "adapter_model.safetensors"))
        for b in _built_with_and_without_the_cast(compress.lora, recipe, tmp_path, monkeypatch)
    ]
    (cast_info, cast_adapter), (auto_info, auto_adapter) = runs
    assert (cast_info["first_loss"], cast_info["final_loss"]) == (
        auto_info["first_loss"],
        auto_info["final_loss"],
    )
    assert cast_adapter.keys() == auto_adapter.keys() and cast_adapter
    assert all(torch.equal(cast_adapter[k], auto_adapter[k]) for k in cast_adapter)


def test_variants_trained_in_different_precisions_in_one_run(tmp_path: Path) -> None:
    """accelerate keeps one state per process and refused the second variant's precision
    ("AcceleratorState has already been initialized and cannot be changed"): a recipe training
    one student in float32 and the next under bf16 (and back) builds all three, each in its own."""
    variants = "".join(
        f"  - {{name: s{i}, steps: [{{distill: {{layers: 1, seq_len: 32, steps: 1, "
        f"batch_size: 2, lr: 0.00{i + 1}, mixed_precision: {p}}}}}]}}\n"
        for i, p in enumerate(["'no'", "bf16", "'no'"])
    )
    (tmp_path / "recipe.yaml").write_text(f"name: m\nbase: demo-tiny\nvariants:\n{variants}")
    recipe, base = load_recipe(tmp_path / "recipe.yaml")
    built = Pipeline(recipe, base, tmp_path / "w").run()
    precisions = [b.manifest.to_json()["info"]["mixed_precision"] for b in built]
    assert precisions == ["no", "bf16", "no"]

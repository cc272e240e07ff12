"""The packed quantization methods through the real pipeline, on a tiny Llama (the demo-tiny
model) and a tiny Gemma 3: every artifact loads with its packed modules, is smaller in memory,
records its calibration, and the engine's greedy tokens equal `generate`'s on it; GPTQ and AWQ
beat round-to-nearest; the mixed plan stays within its budget; bad settings are recipe errors
naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from compress.load_model import load_model
from compress.load_spec import PACKED, read_load_spec
from compress.packed import PackedLinear4, PackedLinear8, PackedLinear8Grouped
from compress.packed_modules import PackedEmbedding4, PackedEmbedding8
from compress.registry import StepError
from evals.artifact_eval import memory_bytes
from tests.serve.conftest import make_cases, reference_outputs
from tests.serve.test_engine_exact import assert_equal, make_engine, run
from workbench.pipeline import Pipeline, PipelineError
from workbench.recipe import RecipeError, load_recipe


def kl_to_base(built: dict[str, Path], name: str) -> float:
    """On held-out text (the corpus's validation split; calibration reads its train split)."""
    from transformers import AutoTokenizer

    from catalog.data import NAMED
    from compress.data import load_texts, token_rows

    tok = AutoTokenizer.from_pretrained(built["base"])
    rows = token_rows(tok, load_texts("corpus", "validation", NAMED), 64)[:16]
    with torch.no_grad():
        p = load_model(built["base"])(rows).logits.log_softmax(-1)
        q = load_model(built[name])(rows).logits.log_softmax(-1)
    return float(torch.nn.functional.kl_div(q, p, log_target=True, reduction="batchmean"))


def test_artifacts_load_packed_and_smaller(built: dict[str, Path]) -> None:
    base_bytes = memory_bytes(load_model(built["base"]))
    for name in ("rtn", "hqq", "gptq", "awq", "gptq8", "gptq8-g32", "mixed"):
        spec = read_load_spec(built[name])
        assert spec.format == "packed" and spec.scheme == name.split("8")[0]
        model = load_model(built[name])
        kinds = {type(m) for m in model.modules()}
        assert kinds & {PackedLinear4, PackedLinear8, PackedLinear8Grouped}, name
        assert memory_bytes(model) < base_bytes, name
    grouped = load_model(built["gptq8-g32"])
    assert set(read_load_spec(built["gptq8-g32"]).module_formats.values()) == {"int8-g32"}
    assert not any(isinstance(m, PackedLinear8) for m in grouped.modules())
    linears = [m for m in grouped.modules() if isinstance(m, PackedLinear8Grouped)]
    assert linears and all(m.groups > 1 and m.offset is None for m in linears)
    gptq8 = load_model(built["gptq8"])
    assert isinstance(gptq8.get_input_embeddings(), PackedEmbedding8)
    if gptq8.config.tie_word_embeddings:  # tied (demo-tiny): the head reads the same int8 codes
        assert gptq8.lm_head is gptq8.get_input_embeddings().linear
    else:
        assert type(gptq8.lm_head) is torch.nn.Linear


def test_int4_embeddings_share_their_codes_with_a_tied_head(built: dict[str, Path]) -> None:
    spec = read_load_spec(built["rtn-emb4"])
    assert spec.params["embeddings"] == "int4-g32"
    model, rtn = load_model(built["rtn-emb4"]), load_model(built["rtn"])
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, PackedEmbedding4)
    if model.config.tie_word_embeddings:
        assert model.lm_head is embedding.linear
        # the float embedding (4 bytes a weight) became 4-bit codes + bfloat16 scales of 32
        vocab, hidden = embedding.num_embeddings, embedding.embedding_dim
        saved = memory_bytes(rtn) - memory_bytes(model)
        assert saved == vocab * hidden * 4 - (vocab * hidden // 2 + vocab * hidden // 32 * 4)
    else:
        assert type(model.lm_head) is torch.nn.Linear


def test_manifest_records_settings_calibration_and_time(built: dict[str, Path]) -> None:
    info = json.loads((built["gptq"] / "workbench.json").read_text())["info"]
    assert info["method"] == "gptq" and info["group_size"] == 32 and info["damp"] == 0.01
    assert info["calibration"]["tokens"] == 16 * 64 and len(info["calibration"]["sha256"]) == 64
    assert info["quantize_seconds"] >= 0
    assert "lm_head" in info["full_precision_linear_layers"]


def test_engine_equals_generate_on_every_packed_format(built: dict[str, Path]) -> None:
    cases = make_cases(8, seed=7, vocab=500, max_prompt=80, max_out=24)
    for name in ("rtn", "hqq", "gptq8", "gptq8-g32", "mixed", "rtn-emb4"):
        reference = reference_outputs(built[name], cases)
        engine = make_engine(built[name], num_blocks=24, budget=64)
        assert_equal(run(engine, cases), reference, list(range(len(cases))))


def test_calibrated_methods_beat_round_to_nearest(built: dict[str, Path]) -> None:
    if "gemma3" in str(built["base"]):
        pytest.skip("the tiny Gemma 3 has random weights: text quality means nothing on it")
    rtn = kl_to_base(built, "rtn")
    assert kl_to_base(built, "gptq") < rtn
    assert kl_to_base(built, "awq") < rtn
    assert kl_to_base(built, "gptq8") < 0.1 * rtn


def test_mixed_plan_within_budget_and_built_as_planned(built: dict[str, Path]) -> None:
    info = json.loads((built["mixed"] / "workbench.json").read_text())["info"]
    assert info["planned_bytes"] <= info["budget_bytes"]
    assert info["planned_bits_per_weight"] <= 6.0
    modules = json.loads((built["mixed"] / PACKED).read_text())["modules"]
    for part, fmt in info["plan"].items():
        layer, kind = part.split(".")
        leaf = {
            "attn_in": "q_proj",
            "attn_out": "o_proj",
            "mlp_in": "gate_proj",
            "mlp_out": "down_proj",
        }[kind]
        key = next(k for k in modules if f"layers.{layer}." in k and k.endswith(f".{leaf}"))
        assert modules[key] == fmt
    assert set(info["sensitivity"]["0.attn_in"]) == {"int4-g32", "int4-g64", "int8"}
    assert info["measured_kl"] >= 0 and info["predicted_kl"] >= 0


BAD = {
    "int8_with_a_group_no_kernel_reads": (
        "{method: rtn, bits: 8, group_size: 48}",
        "group_size",
    ),
    "act_order_without_static_groups": (
        "{method: gptq, group_size: 32, act_order: true}",
        "set static_groups: true",
    ),
    "budget_twice": (
        "{method: mixed, budget: {bits_per_weight: 5, size: 1MB}}",
        "exactly one of bits_per_weight or size",
    ),
    "unknown_candidate": (
        "{method: mixed, budget: {size: 1MB}, candidates: [int2]}",
        "unknown packed format 'int2'",
    ),
    "unknown_embedding_format": ("{method: rtn, embeddings: int4-g48}", "int4-g128"),
    "unknown_method": ("{method: gptqq}", "gptqq"),
    "missing_calibration_data": (
        "{method: gptq, calibration: {data: nowhere.jsonl}}",
        "no such file",
    ),
}


def test_int8_is_per_channel_unless_a_group_size_is_given() -> None:
    from compress.calibrated import RTNParams
    from compress.packed import PackedFormat

    assert RTNParams(method="rtn", bits=8).format == PackedFormat(8, None)
    assert RTNParams(method="rtn", bits=8, group_size=None).format == PackedFormat(8, None)
    assert RTNParams(method="rtn", bits=8, group_size=32).format == PackedFormat(8, 32)
    assert RTNParams(method="rtn").format == PackedFormat(4, 128)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_settings_are_recipe_errors_naming_the_field(case: str, tmp_path: Path) -> None:
    step, message = BAD[case]
    path = tmp_path / "r.yaml"
    path.write_text(
        f"name: x\nbase: demo-tiny\nvariants: [{{name: q, steps: [{{quantize: {step}}}]}}]\n"
    )
    with pytest.raises(RecipeError, match="quantize") as e:
        load_recipe(path)
    assert message in str(e.value)


REFUSED_BUILDS = {
    "int4_embeddings_wider_than_the_hidden_size": (
        "[{quantize: {method: gptq, group_size: 32, embeddings: int4-g128}}]",
        StepError,
        "int4-g128 needs a hidden size divisible by 128",
    ),
    "lora_on_a_packed_variant": (
        "[{quantize: {method: rtn, group_size: 32}}, {lora: {rank: 2, steps: 2}}]",
        PipelineError,
        "LoRA cannot train on a rtn input",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_BUILDS))
def test_a_refused_build_names_the_problem_and_leaves_nothing(case: str, tmp_path: Path) -> None:
    """Refused before any work: by `validate` (LoRA on packed weights) or when the step reads
    the model's shapes (an embedding group wider than the hidden size)."""
    steps, error, message = REFUSED_BUILDS[case]
    path = tmp_path / "r.yaml"
    path.write_text(f"name: x\nbase: demo-tiny\nvariants:\n  - {{name: q, steps: {steps}}}\n")
    recipe, ref = load_recipe(path)
    with pytest.raises(error, match=message):
        Pipeline(recipe, ref, tmp_path / "work").run()
    assert not (tmp_path / "work" / "variants" / "q").exists()


@pytest.mark.parametrize("name", ["rtn-emb4", "gptq8"])
def test_a_packed_embedding_survives_tie_weights_as_lm_eval_calls_it(
    built: dict[str, Path], name: str
) -> None:
    """quant-methods' gptq-g128-emb4 crashed lm-eval: HFLM calls `tie_weights()`, which looked
    for the float `embed_tokens.weight` that a packed embedding does not have."""
    from evals.continuation_lm import ContinuationLM

    model = load_model(built[name])
    tok = AutoTokenizer.from_pretrained(built[name])
    ids = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        before = model(ids).logits
    ContinuationLM(pretrained=model, tokenizer=tok, batch_size=1, max_length=64)  # tie_weights
    model.tie_weights()
    embedding = model.get_input_embeddings()
    assert not isinstance(embedding, torch.nn.Embedding)
    if model.config.tie_word_embeddings:
        assert model.lm_head is embedding.linear
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)

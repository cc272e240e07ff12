"""The engine serves quantized variants (bitsandbytes int8 / nf4, torchao int8 weight-only) with
the same greedy tokens as `generate` on the same quantized model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.serve.conftest import make_cases
from tests.serve.test_engine_exact import make_engine, run
from workbench.pipeline import Pipeline
from workbench.recipe import load_recipe


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    (root / "r.yaml").write_text(
        "name: q\nbase: demo-tiny\nvariants:\n"
        "  - {name: int8, steps: [{quantize: {method: bnb-int8}}]}\n"
        "  - {name: nf4, steps: [{quantize: {method: bnb-nf4}}]}\n"
        "  - {name: int8-wo, steps: [{quantize: {method: int8-wo}}]}\n"
    )
    recipe, base = load_recipe(root / "r.yaml")
    return {r.name: r.path for r in Pipeline(recipe, base, root / "work").run()}


@pytest.mark.parametrize("variant", ["int8", "nf4", "int8-wo"])
def test_engine_greedy_equals_generate_on_quantized_model(
    quantized: dict[str, Path], variant: str
) -> None:
    cases = make_cases(8, seed=5, vocab=500, max_prompt=60, max_out=16)
    model = AutoModelForCausalLM.from_pretrained(quantized[variant], device_map="cpu").eval()
    expected = []
    with torch.inference_mode():
        for c in cases:
            ids = torch.tensor([c.prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=c.max_tokens,
                do_sample=False,
            )
            expected.append(out[0, len(c.prompt) :].tolist())
    engine = make_engine(quantized[variant], num_blocks=64, budget=64)
    outputs = run(engine, cases)
    same = sum(outputs[i] == expected[i] for i in range(len(cases)))
    assert same == len(cases), f"{variant}: {same}/{len(cases)} equal"

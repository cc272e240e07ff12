"""The packed variants of a tiny Llama (demo-tiny) and a tiny Gemma 3, built once through the
real pipeline and shared by the tests of the methods and of their exports."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serve.conftest import make_model
from workbench.pipeline import Pipeline
from workbench.recipe import load_recipe

CAL = "calibration: {samples: 16, seq_len: 64}"
VARIANTS = f"""\
variants:
  - {{name: base, steps: []}}
  - {{name: rtn, steps: [{{quantize: {{method: rtn, group_size: 32}}}}]}}
  - {{name: rtn-sym, steps: [{{quantize: {{method: rtn, group_size: 32, sym: true}}}}]}}
  - {{name: rtn-emb4, steps: [{{quantize: {{method: rtn, group_size: 32, embeddings: int4}}}}]}}
  - {{name: hqq, steps: [{{quantize: {{method: hqq, group_size: 64}}}}]}}
  - {{name: gptq, steps: [{{quantize: {{method: gptq, group_size: 32, {CAL}}}}}]}}
  - {{name: gptq8, steps: [{{quantize: {{method: gptq, bits: 8, group_size: null, act_order: true, embeddings: int8, {CAL}}}}}]}}
  - {{name: gptq8-g32, steps: [{{quantize: {{method: gptq, bits: 8, group_size: 32, sym: true, act_order: true, static_groups: true, {CAL}}}}}]}}
  - {{name: awq, steps: [{{quantize: {{method: awq, group_size: 32, {CAL}}}}}]}}
  - name: mixed
    steps: [{{quantize: {{method: mixed, budget: {{bits_per_weight: 6.0}}, candidates: [int4-g32, int4-g64, int8], quantizer: gptq, scan: {{samples: 4, seq_len: 64}}, {CAL}}}}}]
"""


@pytest.fixture(scope="session", params=["demo-tiny", "gemma3"])
def built(
    request: pytest.FixtureRequest, tmp_path_factory, tiny_model_dir: Path
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp(request.param)
    base = "demo-tiny"
    if request.param == "gemma3":
        base = str(make_model("gemma3", tiny_model_dir, root / "gemma3"))
    (root / "recipe.yaml").write_text(f"name: packed\nbase: {base}\n{VARIANTS}")
    recipe, ref = load_recipe(root / "recipe.yaml")
    return {r.name: r.path for r in Pipeline(recipe, ref, root / "work").run()}

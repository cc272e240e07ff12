"""`benchmarks.weight_error`: a quantized variant's divergence split into its weights' and the
kernels' bfloat16 compute."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def test_weight_error_separates_compute_dtype_from_weight_format(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Bfloat16 compute alone costs less than int8 weights, which cost less than int4; int8 with
    groups of 32 less than per channel; the head is never touched."""
    import json

    from benchmarks.weight_error import main

    out = tmp_path / "weight-error.json"
    cases = "bf16-linears,int8,int8-g32,int4-g128"
    argv = ["--model", str(tiny_model_dir), "--cases", cases, "--data", "corpus"]
    assert main([*argv, "--windows", "4", "--seq-len", "64", "--out", str(out)]) == 0
    kl = {c: r["corpus"]["kl_mean"] for c, r in json.loads(out.read_text()).items() if c != "model"}
    assert 0 < kl["bf16-linears"] < kl["int8"] < kl["int4-g128"]
    assert kl["int8-g32"] < kl["int8"]


def test_weight_error_cases_leave_the_head_and_embedding_alone(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from benchmarks.weight_error import apply_case

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_case(model, AutoTokenizer.from_pretrained(tiny_model_dir), "int4-g128")
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed)
    assert "lm_head.weight" not in changed and "model.embed_tokens.weight" not in changed

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


def test_mse_range_search_never_rounds_worse_than_the_full_range() -> None:
    """The search includes the full range (shrink 1), so no row of a group rounds with more
    l_2.4 error than plain round-to-nearest; on Gaussian weights most rows gain by clipping
    their tails."""
    from benchmarks.weight_error import _rtn_mse
    from compress.grids import rtn
    from compress.packed import PackedFormat

    torch.manual_seed(0)
    w = torch.randn(16, 256)
    fmt = PackedFormat(4, 128)
    searched, plain = _rtn_mse(w, fmt), rtn(w, fmt).dequantize()

    def group_error(q: torch.Tensor) -> torch.Tensor:
        return (q - w).abs().pow(2.4).reshape(16, 2, 128).sum(-1)

    assert (group_error(searched) <= group_error(plain) * (1 + 1e-6)).all()
    assert (group_error(searched) < group_error(plain)).float().mean() > 0.5
    assert searched.abs().max() < w.abs().max()


def test_hqq_slow_solver_is_swapped_in_for_the_call_only() -> None:
    from hqq.core.quantize import Quantizer

    from benchmarks.weight_error import _hqq_slow
    from compress.grids import hqq
    from compress.packed import PackedFormat

    default = Quantizer.optimize_weights
    torch.manual_seed(0)
    w = torch.randn(8, 256)
    slow, fast = _hqq_slow(w, PackedFormat(4, 128)), hqq(w, PackedFormat(4, 128)).dequantize()
    assert Quantizer.optimize_weights is default
    assert not torch.equal(slow, fast)
    assert (slow - w).abs().mean() <= (fast - w).abs().mean() * 1.01

"""`benchmarks.kv_cache_bench`: int8 against float KV cache at one budget, on the tiny demo model."""

from __future__ import annotations

import json
from pathlib import Path


def test_kv_cache_bench_reports_capacity_speed_and_divergence(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from benchmarks.kv_cache_bench import main

    out = tmp_path / "kv.json"
    argv = ["--model", str(tiny_model_dir), "--requests", "12", "--prompt-len", "32"]
    argv += ["--max-tokens", "8", "--decode-batch", "4", "--rounds", "1", "--kv-budget", "64KiB"]
    argv += ["--data", "corpus", "--windows", "2", "--seq-len", "64", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    auto, int8 = result["serving"]["auto"], result["serving"]["int8"]
    assert int8["kv_tokens"] > 3 * auto["kv_tokens"]
    assert int8["bytes_per_token"] * 3 < auto["bytes_per_token"]
    assert max(int8["runs"]["peak_running"]) > max(auto["runs"]["peak_running"])
    corpus = result["quality"]["corpus"]
    assert 0 < corpus["kl_mean"] < 0.05
    assert corpus["top1_agreement"] > 0.9 and corpus["engine_top1_agreement"] > 0.9

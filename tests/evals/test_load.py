"""The HTTP load benchmark against a real server it starts: points, percentiles, saturation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals.load import percentiles
from workbench.cli import main


def test_percentiles() -> None:
    p = percentiles([float(i) for i in range(1, 101)])
    assert (p.p50, p.p95, p.p99, p.mean) == (50.5, 95.05, 99.01, 50.5)


@pytest.mark.e2e  # `workbench bench` starts the server in a subprocess
def test_bench_finds_kv_saturation(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A KV cache of 16 blocks x 16 tokens holds 3.2 requests of 16 + 64 tokens: at 2 clients
    nothing queues; at 8, requests wait while the cache is full."""
    out = tmp_path / "bench.json"
    # tiny model: 2 layers x 2 KV heads x 16 dims x 4 bytes x (K, V) = 512 bytes per token
    code = main(
        [
            "bench",
            str(tiny_model_dir),
            "--concurrency",
            "2,8",
            "--prompt-len",
            "16",
            "--max-tokens",
            "64",
            "--requests",
            "24",
            "--out",
            str(out),
            "--kv-cache-memory",
            str(16 * 16 * 512),
            "--device",
            "cpu",
            "--max-num-seqs",
            "16",
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert result["kv_tokens"] == 256
    low, high = result["points"]
    assert (low["concurrency"], high["concurrency"]) == (2, 8)
    assert low["requests"] == high["requests"] == 24 and low["failed"] == high["failed"] == 0
    assert not low["saturated"] and low["peak_waiting"] == 0 and low["kv_full_queued_steps"] == 0
    assert high["saturated"] and high["kv_full_queued_steps"] > 0
    assert high["peak_kv_usage"] >= 0.9 and high["peak_waiting"] > 0
    assert high["ttft"]["p95"] >= high["ttft"]["p50"] > 0 and high["output_throughput"] > 0
    sat = result["saturation"]["16"]
    assert sat["measured_concurrency"] == 8 and abs(sat["estimated_concurrency"] - 256 / 80) < 1e-9


@pytest.mark.e2e  # starts the server in a subprocess
def test_workbench_api_key_in_the_shell_does_not_lock_out_the_evals_own_server(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README recommends exporting WORKBENCH_API_KEY; `workbench run` then got 401 from the
    server it starts for its own measurements."""
    import httpx

    from evals.load_cli import served

    monkeypatch.setenv("WORKBENCH_API_KEY", "sk-users-own-key")
    with served(str(tiny_model_dir), ["--device", "cpu"], tmp_path / "server.log") as url:
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200


@pytest.mark.e2e  # `workbench bench` starts the server in a subprocess
def test_bench_request_rates_and_capacity_within_an_slo(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    flags = ["--concurrency", "1,4", "--prompt-len", "16", "--max-tokens", "8", "--requests", "8"]
    flags += ["--request-rate", "40", "--num-prompts", "8", "--slo", "ttft:5000"]
    flags += ["--slo-search-steps", "2", "--out", str(out), "--device", "cpu"]
    assert main(["bench", str(tiny_model_dir), *flags]) == 0
    result = json.loads(out.read_text())
    (rate_point,) = result["rate_points"]
    assert rate_point["request_rate"] == 40 and rate_point["requests"] == 8
    assert rate_point["itl"]["p50"] > 0 and rate_point["failed"] == 0
    cap = result["capacity"]["16"]
    assert cap["slo"] == {"ttft_p95_s": 5.0} and cap["concurrency"] == 4
    # the peak met a 5 s bound: it is the capacity (nothing above it is sustainable), one point
    peak = max(p["request_throughput"] for p in result["points"])
    assert [p["request_rate"] for p in cap["searched"]] == [peak] and cap["request_rate"] == peak


@pytest.mark.e2e  # `workbench bench` starts the server in a subprocess
def test_bench_exit_code_counts_failed_requests(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Prompts longer than the server's context are refused (400): counted, and exit code 1."""
    out = tmp_path / "bench.json"
    flags = ["--concurrency", "2", "--prompt-len", "40", "--max-tokens", "4", "--requests", "4"]
    flags += ["--out", str(out), "--device", "cpu", "--max-model-len", "32"]
    assert main(["bench", str(tiny_model_dir), *flags]) == 1
    (point,) = json.loads(out.read_text())["points"]
    assert point["failed"] == 4 and point["requests"] == 0

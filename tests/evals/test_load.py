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


@pytest.mark.e2e  # starts two servers
def test_servers_fork_from_one_warm_forkserver_in_the_callers_directory(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both servers are children of the same forkserver (which imported the engine once), not
    of this process; the second, started after a `chdir` and with an environment of its own,
    finds a model named relative to the new directory and serves under that environment's API
    key, as `python -m serve` started there would."""
    import os
    import time

    import httpx

    from evals.load_cli import _free_port
    from evals.server_process import start_server

    def up(port: int, process: object, headers: dict[str, str]) -> int:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.exitcode is None:  # type: ignore[attr-defined]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers).status_code
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(f"no server on {port}: {process}")

    def parent(pid: int) -> int:
        status = (Path("/proc") / str(pid) / "status").read_text()
        return int(status.split("PPid:")[1].split()[0])

    parents, codes = [], []
    env = dict(os.environ)
    for i, model in enumerate([str(tiny_model_dir), tiny_model_dir.name]):
        if i == 1:
            monkeypatch.chdir(tiny_model_dir.parent)
            env["WORKBENCH_API_KEY"] = "sk-second"
        port = _free_port()
        argv = [model, "--port", str(port), "--device", "cpu"]
        process = start_server(argv, tmp_path / f"server-{i}.log", env)
        try:
            codes.append(up(port, process, {}))
            if i == 1:
                codes.append(up(port, process, {"Authorization": "Bearer sk-second"}))
            parents.append(parent(process.pid))  # type: ignore[arg-type]
        finally:
            process.terminate()
            process.join(60)
        assert process.exitcode == 0
    assert codes == [200, 401, 200]
    assert parents[0] == parents[1] != os.getpid()

"""vLLM as a benchmark system: the worker protocol over a stand-in `vllm` package (its offline
API's shape: `LLM`, `SamplingParams`, `TokensPrompt`). The real vLLM runs in `benchmarks/` only
(its own venv; figures in the README)."""

from __future__ import annotations

import stat
import sys
import time
from pathlib import Path

import pytest

from benchmarks.vllm_system import VllmError, VllmWorker, agreement

FAKE_VLLM = """
import os
print("INFO vllm banner on stdout")  # vLLM logs to stdout: must not reach the protocol
__version__ = "0.0-fake"
class SamplingParams:
    def __init__(self, max_tokens, temperature, min_tokens=None, ignore_eos=False,
                 logprobs=None, prompt_logprobs=None):
        assert temperature == 0.0
        if prompt_logprobs is None:  # a generate call: exact lengths
            assert min_tokens == max_tokens and ignore_eos
        self.max_tokens, self.logprobs = max_tokens, logprobs
        self.prompt_logprobs = prompt_logprobs
class Logprob:  # vLLM's: a logprob and its rank among the position's tokens
    def __init__(self, logprob, rank): self.logprob, self.rank = logprob, rank
class _Sched:
    max_num_seqs = 256
    max_num_batched_tokens = 4096
class _Config:
    scheduler_config = _Sched()
class _Engine:
    vllm_config = _Config()
class _Completion:
    def __init__(self, ids, logprobs=None): self.token_ids, self.logprobs = ids, logprobs
class _Out:
    def __init__(self, ids, logprobs=None, prompt_logprobs=None):
        self.outputs = [_Completion(ids, logprobs)]
        self.prompt_logprobs = prompt_logprobs
class LLM:
    def __init__(self, **options):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("no kernel for this CPU")
        if os.environ.get("FAKE_VLLM_CHILD"):  # as vLLM's engine core: a process of its own
            import subprocess, sys
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            open(os.environ["FAKE_VLLM_CHILD"], "w").write(str(child.pid))
        print("INFO engine up")
        self.llm_engine = _Engine()
    def generate(self, prompts, params, use_tqdm):
        print("INFO generating")
        if not isinstance(params, list):
            params = [params] * len(prompts)
        outs = []
        for p, s in zip(prompts, params):
            ids = p["prompt_token_ids"]
            if s.prompt_logprobs is not None:  # each prompt token at -0.5, its successor top-1
                scored = [None] + [{t: Logprob(-0.5, 2), t + 1: Logprob(-0.1, 1)} for t in ids[1:]]
                outs.append(_Out([0], prompt_logprobs=scored))
                continue
            out = [ids[-1] + k for k in range(s.max_tokens)]
            lps = [{t: Logprob(-0.25 * k, 1)} for k, t in enumerate(out)]
            outs.append(_Out(out, lps if s.logprobs is not None else None))
        return outs
"""


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    """A 'venv' whose python finds the stand-in `vllm` first."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (site / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                             "    return {'prompt_token_ids': prompt_token_ids}\n")  # fmt: skip
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return tmp_path / "venv"


def test_the_worker_answers_generate_calls_over_its_pipe_with_vllm_logging_kept_off_it(
    fake_venv: Path, tmp_path: Path
) -> None:
    log = tmp_path / "vllm.log"
    worker = VllmWorker(
        fake_venv, tmp_path / "model", log, max_num_batched_tokens=2048, enforce_eager=True
    )
    with worker:
        assert worker.version == "0.0-fake"
        assert worker.config["enforce_eager"] is True
        assert worker.config["max_num_batched_tokens"] == 4096  # as the engine reports it
        assert worker.config["enable_prefix_caching"] is False
        assert worker.config["kv_cache_space_gib"] == "2"
        first = worker.generate([[5, 6], [9]], [3, 1])
        second = worker.generate([[1]], [2])
    assert first.outputs == [[6, 7, 8], [9]] and second.outputs == [[1, 2]]
    assert first.seconds >= 0
    assert "vllm banner" in log.read_text() and "generating" in log.read_text()


def test_the_worker_returns_chosen_logprobs_and_scores_windows(
    fake_venv: Path, tmp_path: Path
) -> None:
    with VllmWorker(fake_venv, tmp_path / "model", tmp_path / "vllm.log") as worker:
        plain = worker.generate([[5]], [2])
        with_logprobs = worker.generate([[5], [9]], [3, 1], logprobs=True)
        scored = worker.score([[1, 2, 3], [7, 8]])
    assert plain.logprobs is None
    assert with_logprobs.outputs == [[5, 6, 7], [9]]
    assert with_logprobs.logprobs == [[0.0, -0.25, -0.5], [0.0]]
    assert scored == {"nll": [0.5, 0.5], "top1": [[3, 4], [9]]}


def test_the_export_check_compares_answers_over_their_common_start() -> None:
    from benchmarks.vllm_export_check import compare_answers

    ours = [([1, 2, 3], [-0.1, -0.2, -0.3]), ([4, 5, 6], [-1.0, -1.0, -1.0])]
    theirs = [([1, 2, 3], [-0.1, -0.25, -0.3]), ([4, 7, 8], [-1.5, -9.0, -9.0])]
    got = compare_answers(ours, theirs)
    # the second answers part after one token: only that token's logprobs compare
    assert got == {
        "answers_identical": 1,
        "answers": 2,
        "common_start_tokens": 2.0,
        "largest_logprob_difference": pytest.approx(0.5),
    }


def test_the_export_check_reads_vllms_log(tmp_path: Path) -> None:
    from benchmarks.vllm_export_check import log_facts

    log = tmp_path / "vllm.log"
    log.write_text(
        "(Worker pid=1) INFO [__init__.py:846] Selected CPUInt8ScaledMMLinearKernel for "
        "CompressedTensorsW8A8Int8\n... Checkpoint size: 0.21 GiB. Available RAM: 17.61 GiB.\n"
        "(EngineCore pid=2) INFO [kv_cache_utils.py:2327] CPU KV cache size: 46,592 tokens, "
        "Maximum concurrency for 2,048 tokens per request: 22.75x\n"
    )
    assert log_facts(log) == {
        "kernel": "CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8",
        "checkpoint_gib": "0.21",
        "kv_cache_tokens": "46,592",
    }
    log.write_text(  # the 4-bit scheme's line, after a generic one
        "INFO [__init__.py:923] Using CPUWNA16LinearKernel for mixed-precision linear\n"
        "INFO [compressed_tensors_wNa16.py:138] Using CPUWNA16LinearKernel for "
        "CompressedTensorsWNA16\n"
    )
    assert log_facts(log) == {"kernel": "CPUWNA16LinearKernel for CompressedTensorsWNA16"}


def test_a_worker_that_dies_at_start_raises_naming_its_log(
    fake_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    log = tmp_path / "vllm.log"
    with pytest.raises(VllmError, match=str(log)):
        VllmWorker(fake_venv, tmp_path / "model", log).start()
    assert "no kernel for this CPU" in log.read_text()


def state_letter(pid: int) -> str | None:
    """The process's state from /proc (R, S, T stopped, Z zombie, ...); None: no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    return state_letter(pid) not in (None, "Z")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_closing_the_worker_ends_the_processes_vllm_started(
    fake_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's engine core and CPU worker are processes of their own that outlived the frontend
    (busy for a minute) and slowed the next measurement: close() ends the whole group."""
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_VLLM_CHILD", str(pid_file))
    with VllmWorker(fake_venv, tmp_path / "model", tmp_path / "vllm.log") as worker:
        worker.generate([[1]], [1])
        child = int(pid_file.read_text())
        assert running(child)
    assert not running(child)


def state(pid: int) -> str | None:
    """The process's state letter, once it has settled on stopped (T) or 2 s have passed
    (a signal is delivered asynchronously)."""
    deadline = time.monotonic() + 2
    while (letter := state_letter(pid)) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    return letter


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_vllms_processes_are_stopped_between_calls(
    fake_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between generate calls every vLLM process is stopped (vLLM's workers spin for a second
    after a call and slowed the other system's round 3.5x), resumed for the next call, and a
    stopped worker still closes."""
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_VLLM_CHILD", str(pid_file))
    with VllmWorker(fake_venv, tmp_path / "model", tmp_path / "vllm.log") as worker:
        assert worker._process is not None
        first = worker.generate([[1]], [2])
        child = int(pid_file.read_text())
        assert state(worker._process.pid) == "T" and state(child) == "T"
        assert worker.generate([[4]], [1]).outputs == [[4]] and first.outputs == [[1, 2]]
        assert state(worker._process.pid) == "T"
    assert not running(child)


def test_a_missing_venv_is_refused_with_how_to_build_one(tmp_path: Path) -> None:
    with pytest.raises(VllmError, match=r"vllm_venv\.sh"):
        VllmWorker(tmp_path / "nowhere", tmp_path, tmp_path / "log").start()


def test_agreement_counts_requests_with_identical_outputs() -> None:
    assert agreement([[1, 2], [3], [4]], [[1, 2], [3, 0], [4]]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        agreement([[1]], [[1], [2]])


def test_worker_script_has_no_workbench_imports() -> None:
    """It runs in vLLM's venv, where the workbench is not installed."""
    source = Path("benchmarks/vllm_worker.py").read_text()
    for package in ("compress", "serve", "evals", "workbench", "benchmarks", "catalog"):
        assert f"from {package}" not in source and f"import {package}" not in source


def test_the_worker_runs_as_vllms_cpu_guide_advises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenMP bound to `threads` cores with none reserved, this process's OpenMP wait policy
    not passed on, the guide's preloads where they exist; a variable the caller set wins."""
    import os

    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    worker = VllmWorker(tmp_path, tmp_path, tmp_path / "log", threads=1)
    env = worker.environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(min(os.sched_getaffinity(0)))
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and "OMP_WAIT_POLICY" not in env
    assert str(tmp_path / "lib" / "libiomp5.so") not in env["LD_PRELOAD"]
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    preload = worker.environment()["LD_PRELOAD"].split(":")
    assert str(tmp_path.resolve() / "lib" / "libiomp5.so") in preload
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert worker.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_vllm_check_gets_the_workers_environment_for_its_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m benchmarks.vllm_system env VENV`: `env(1)` arguments, one a line, dropping
    the OpenMP wait policy and adding what is not set already."""
    from benchmarks.vllm_system import main

    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "8")
    assert main(["env", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["-u", "OMP_WAIT_POLICY"]
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=0" in lines
    assert any(line.startswith("VLLM_CPU_OMP_THREADS_BIND=") for line in lines)
    assert not any(line.startswith("VLLM_CPU_KVCACHE_SPACE=") for line in lines)  # set: kept

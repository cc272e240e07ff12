"""`workbench` as a user runs it: how a command ends when it is told to stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = """name: lifecycle
base: demo-tiny
variants:
  - {name: base, steps: []}
evals:
  load: {concurrency: [1], prompt_len: [16], max_tokens: 64, requests_per_point: 100000}
"""
"""A load sweep far longer than the test: the run is inside it when it is told to stop."""


def session_processes(sid: int) -> dict[int, str]:
    """{pid: command line} of the live (not zombie) processes of session `sid`, from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return found


def _wait_for(
    condition: Callable[[], bool], what: str, proc: subprocess.Popen, limit_s: float
) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert proc.poll() is None, f"workbench exited before its {what} was up"
        assert time.monotonic() < deadline, f"no {what} within {limit_s} s"
        time.sleep(0.1)


@pytest.mark.e2e  # `workbench run` in a session of its own, its eval server, a signal
def test_sigterm_to_workbench_run_leaves_no_process_behind(tmp_path: Path) -> None:
    """SIGTERM to `workbench run` while its eval server ran left three of the processes it
    started alive 30 s later (the server, multiprocessing's forkserver and resource tracker):
    now every one has ended by the time `workbench run` has."""
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with (tmp_path / "run.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workbench.cli", "run", "recipe.yaml"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        server_log = tmp_path / "runs" / "lifecycle" / "evals" / "server-base.log"
        _wait_for(
            lambda: server_log.is_file() and "Uvicorn running on" in server_log.read_text(),
            "eval server",
            proc,
            600,
        )
        started = set(session_processes(proc.pid)) - {proc.pid}
        assert len(started) >= 3, session_processes(proc.pid)  # server, forkserver, tracker
        leaders = [pid for pid in started if os.getpgid(pid) == pid]
        assert len(leaders) == 1, "the eval server leads a process group of its own"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 128 + signal.SIGTERM
        left = session_processes(proc.pid)
        assert left == {}, left
        output = (tmp_path / "run.log").read_text()
        assert "Traceback" not in output, output[-3000:]
    finally:
        for pid in session_processes(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)

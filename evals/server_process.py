"""Server processes forked from one warm parent, so each starts without importing the world.

Model: a `python -m serve` spends about 5 s importing torch, transformers and the engine before
it reads a model (SmolLM2-135M: 6.2-7.2 s to its first healthy `/health` on 2 cores, 1.4-2.0 s of
them the model's load and the engine's set-up). A recipe's serving evaluations start one server
per variant, so servers are forked from `multiprocessing`'s forkserver, which imports those
modules once (`PRELOAD`) and has computed nothing (no OpenMP pool, no threads): a fork of it is
as clean as a fresh interpreter and is serving after the load alone. What a fork cannot change
is what was read at import time: the environment as the forkserver saw it (this process's, when
the first server started); each server is handed the environment and working directory it is
started with before its own code runs. The forkserver lives as long as this process.

Lifecycle: each server leads a process group of its own, so `stop_server` ends it with anything
it started, and a Ctrl-C at the terminal (sent to the foreground group) reaches this process
alone, which then stops its servers in order. Every server started is stopped on any exit of
this process that runs Python's exit handlers (return, exception, and SIGTERM / SIGHUP once
`workbench.cli` turns them into `SystemExit`). The forkserver and multiprocessing's resource
tracker end by themselves once no server holds their pipes open.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
from multiprocessing.process import BaseProcess
from pathlib import Path

PRELOAD = ["__main__", "serve.http.cli", "transformers.modeling_utils"]
"""Imported once in the forkserver: this program's main module (or every server would import it
again), the server with its engine, and what loading any model needs."""


def _serve(argv: list[str], log: str, env: dict[str, str], cwd: str) -> None:
    """The child: a process group of its own, its output to `log`, the caller's environment,
    then the server's own main."""
    os.setpgid(0, 0)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    from serve.http.cli import main

    raise SystemExit(main(argv))


def start_server(argv: list[str], log: Path, env: dict[str, str]) -> BaseProcess:
    """`python -m serve *argv` as a started process writing to `log`, forked warm."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    process = context.Process(
        target=_serve, args=(argv, str(log), env, os.getcwd()), name="workbench-server"
    )
    process.start()
    _RUNNING.add(process)
    return process


_RUNNING: set[BaseProcess] = set()
"""Servers started and not yet stopped: stopped at exit."""


def stop_server(process: BaseProcess, grace_s: float = 60.0) -> None:
    """SIGTERM to the server's process group (a graceful shutdown), SIGKILL to what is left of
    it after `grace_s`; the server is reaped."""
    _RUNNING.discard(process)
    _signal_group(process, signal.SIGTERM)
    process.join(timeout=grace_s)
    _signal_group(process, signal.SIGKILL)
    process.join()


def _signal_group(process: BaseProcess, sig: signal.Signals) -> None:
    """`sig` to the group the server leads (its descendants too, after it exited); to the
    server alone while it has not made its group yet."""
    assert process.pid is not None
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:  # no such group: not made yet, or every member has ended
        if process.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, sig)


@atexit.register
def _stop_running() -> None:
    """The servers still running, then the forkserver and the resource tracker (which would
    end by themselves seconds later), so that nothing started here outlives this process."""
    for process in list(_RUNNING):
        stop_server(process)
    from multiprocessing import forkserver, resource_tracker

    # NOTE: multiprocessing's own (private) stops: each closes its pipe and waits for the
    # helper to end; each returns at once when its helper was never started
    helpers = (
        getattr(forkserver, "_forkserver", None),
        getattr(resource_tracker, "_resource_tracker", None),
    )
    for helper in helpers:
        with contextlib.suppress(OSError, AttributeError):
            helper._stop()  # type: ignore[union-attr]

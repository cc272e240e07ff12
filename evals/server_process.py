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
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.process import BaseProcess
from pathlib import Path

PRELOAD = ["__main__", "serve.http.cli", "transformers.modeling_utils"]
"""Imported once in the forkserver: this program's main module (or every server would import it
again), the server with its engine, and what loading any model needs."""


def _serve(argv: list[str], log: str, env: dict[str, str], cwd: str) -> None:
    """The child: its output to `log`, the caller's environment, then the server's own main."""
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
    return process

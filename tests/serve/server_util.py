"""Run the real server (uvicorn) on 127.0.0.1 and a free port, in a thread or a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.engine.async_engine import AsyncEngine
from serve.engine.llm_engine import LLMEngine
from serve.engine.metrics import ServerMetrics
from serve.http.server import ServerSettings, build_app
from serve.lora.registry import LoraConfig


@dataclass
class ThreadServer:
    url: str
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def start_thread_server(
    model_dir: Path,
    name: str = "test-model",
    num_blocks: int = 1024,
    max_num_seqs: int = 64,
    max_model_len: int = 512,
    lora: LoraConfig | None = None,
    generation_config: str = "auto",
    device: str = "cpu",
    async_scheduling: bool = False,
    **settings: object,
) -> ThreadServer:
    engine = LLMEngine(
        ModelConfig(
            str(model_dir), dtype="float32", device=device, generation_config=generation_config
        ),
        CacheConfig(block_size=16, num_blocks=num_blocks),
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=512,
            max_model_len=max_model_len,
            async_scheduling=async_scheduling,
        ),
        lora=lora,
    )
    server_settings = ServerSettings(name, **settings)  # type: ignore[arg-type]
    async_engine = AsyncEngine(engine, ServerMetrics(name), server_settings.max_unread_tokens)
    app = build_app(async_engine, server_settings)
    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    wait_healthy(url)
    return ThreadServer(url, async_engine, server, thread)


def wait_healthy(url: str, timeout: float = 120, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy")


def start_subprocess_server(
    model_dir: Path, log: Path, *flags: str
) -> tuple[subprocess.Popen, str]:
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    cmd = [
        sys.executable,
        "-m",
        "workbench.cli",
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        "test-model",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        *flags,
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=os.environ, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc=proc)
    return proc, url


def wait_engine_drained(server: ThreadServer, timeout: float = 30) -> None:
    """Until no request is tracked by the HTTP side nor held by the engine: an abort ends the
    request's tracking at once and reaches the engine's thread (which frees its blocks) a step
    later, so a test that checks blocks must wait for the engine, not for the tracking."""
    deadline = time.monotonic() + timeout
    while server.engine.num_unfinished or server.engine.engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still running after {timeout} s")
        time.sleep(0.02)


def slow_steps_until_abort(server: ThreadServer, monkeypatch: object) -> list[str]:
    """Slow every engine step to 20 ms until the HTTP layer asks for an abort, so a long request
    is still running when its client leaves, however fast the machine; returns the request ids
    whose abort was asked (filled as it happens)."""
    asked: list[str] = []
    real_step, real_abort = server.engine.engine.step, server.engine.abort_all

    def step():  # type: ignore[no-untyped-def]
        if not asked:
            time.sleep(0.02)
        return real_step()

    async def abort_all(request_ids: list[str], reason: str = "abort") -> None:
        asked.extend(request_ids)
        await real_abort(request_ids, reason)

    monkeypatch.setattr(server.engine.engine, "step", step)  # type: ignore[attr-defined]
    monkeypatch.setattr(server.engine, "abort_all", abort_all)  # type: ignore[attr-defined]
    return asked


def slow_steps_for(server: ThreadServer, seconds: float) -> None:
    """Slow every engine step to 50 ms for the next `seconds`: requests sent at once in that
    time all arrive before any of them can finish, however fast the machine."""
    engine = server.engine.engine
    real_step = getattr(engine, "_unslowed_step", engine.step)
    engine._unslowed_step = real_step  # type: ignore[attr-defined]
    until = time.monotonic() + seconds

    def step():  # type: ignore[no-untyped-def]
        if time.monotonic() < until:
            time.sleep(0.05)
        return real_step()

    engine.step = step  # type: ignore[method-assign]

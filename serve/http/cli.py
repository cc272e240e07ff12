"""`workbench serve` and `python -m serve`: flags for every engine and server setting, and the
uvicorn run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from pathlib import Path

import torch
import uvicorn

from compress.artifact import MANIFEST
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.engine.async_engine import AsyncEngine
from serve.engine.llm_engine import InvalidRequest, LLMEngine
from serve.engine.metrics import ServerMetrics
from serve.http.flags import add_config_flags, config_from_args, given, int_in
from serve.http.server import ServerSettings, build_app
from serve.http.state import read_chat_template
from serve.lora.registry import AdapterError, LoraConfig

API_KEY_ENV = "WORKBENCH_API_KEY"

SPELLING = {
    "kv_cache_bytes": "--kv-cache-memory",
    "kv_cache_memory_fraction": "--kv-cache-fraction",
    "model_name": "--served-model-name",
}
"""Flags whose name is not the field's (vLLM's spelling, or the server's)."""


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The server's flags: those of the engine configs and `ServerSettings` derived from their
    fields (`serve.http.flags`), and the few that belong to the process (bind, threads)."""
    p.add_argument(
        "model",
        help="variant dir, HF model dir, .gguf file, hub id, demo / demo-tiny, or smollm2-135m",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int_in(0, 65535),
        default=8000,
        help="port to bind (default 8000; 0 = any free)",
    )
    p.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM",
    )
    add_config_flags(
        p,
        ServerSettings,
        SPELLING,
        {"model_name": "the variant name or dir name", "api_key": f"${API_KEY_ENV}"},
        skip=("bind_host",),
    )
    g = p.add_argument_group("engine")
    add_config_flags(g, ModelConfig, SPELLING, skip=("model",))
    add_config_flags(
        g,
        CacheConfig,
        SPELLING,
        {"kv_cache_bytes": "256MiB on the CPU, --kv-cache-fraction of free memory on a GPU"},
    )
    add_config_flags(g, SchedulerConfig, SPELLING, {"max_model_len": "the model's position limit"})
    g.add_argument("--threads", type=int_in(1), help="torch CPU threads (default: torch's choice)")
    g.add_argument(
        "--seed",
        type=int_in(0, 2**64 - 1),
        default=0,
        help="seed of the sampler for requests without their own seed (default 0)",
    )
    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="load this PEFT adapter at start (repeatable); clients select it with model=NAME",
    )
    add_config_flags(g, LoraConfig, SPELLING)


def served_name(model: str) -> str:
    path = Path(model)
    manifest = path / MANIFEST
    if manifest.is_file():
        return json.loads(manifest.read_text()).get("variant") or path.name
    return path.name if path.exists() else model


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    """LoRA serving is on when an adapter or any LoRA setting is given."""
    if not given(LoraConfig, args) and not args.lora:
        return None
    return config_from_args(LoraConfig, args)


def initial_loras(args: argparse.Namespace) -> list[tuple[str, Path]]:
    pairs = []
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(
                f"--lora {spec!r}: give NAME=PATH, e.g. --lora shop=runs/demo/variants/shop-lora"
            )
        pairs.append((name, Path(path)))
    return pairs


def build_engine(args: argparse.Namespace) -> LLMEngine:
    """The engine the flags describe; a setting that cannot work exits with a one-line error."""
    if args.threads:
        torch.set_num_threads(args.threads)
    loras = initial_loras(args)
    lora_root = getattr(args, "lora_root", None)
    if lora_root is not None and not lora_root.is_dir():
        raise SystemExit(f"--lora-root {lora_root}: no such directory")
    try:
        engine = _engine(args)
    except (ValueError, OSError) as e:
        raise SystemExit(f"workbench serve: {e}") from None
    except torch.OutOfMemoryError as e:
        raise SystemExit(f"workbench serve: out of memory while loading ({e})") from None
    for name, path in loras:
        try:
            engine.load_lora(name, str(path))
        except (AdapterError, InvalidRequest) as e:
            raise SystemExit(f"--lora {name}={path}: {e}") from None
    return engine


def _engine(args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(
        config_from_args(ModelConfig, args, model=args.model),
        config_from_args(CacheConfig, args),
        config_from_args(SchedulerConfig, args),
        seed=args.seed,
        lora=lora_config(args),
    )


def resolve_model_name(args: argparse.Namespace) -> None:
    """A built-in name (`demo`, `smollm2-135m`) or a `.gguf` file becomes its model dir, built
    or converted on first use, served under the name itself."""
    from catalog.names import named_model_dir

    model_dir = named_model_dir(args.model)
    if model_dir is not None:
        if not getattr(args, "model_name", None):
            args.model_name = Path(args.model).stem
        args.model = str(model_dir)


def main(argv: list[str] | None = None) -> int:
    """`python -m serve MODEL [flags]`: the server without the rest of workbench."""
    parser = argparse.ArgumentParser(
        prog="python -m serve", description="Serve a model over an OpenAI-compatible HTTP API."
    )
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    from catalog.gguf_file import BadGGUF

    try:
        resolve_model_name(args)
    except BadGGUF as e:
        parser.exit(2, f"error: {e}\n")
    return run_server(args)


def run_server(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    name = getattr(args, "model_name", None) or served_name(args.model)
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None
    settings = config_from_args(
        ServerSettings, args, model_name=name, api_key=api_key, bind_host=args.host
    )
    try:
        read_chat_template(settings.chat_template)
    except ValueError as e:
        raise SystemExit(f"workbench serve: {e}") from None
    engine = build_engine(args)
    app = build_app(AsyncEngine(engine, ServerMetrics(name), settings.max_unread_tokens), settings)
    block_size = engine.cache_config.block_size
    logging.getLogger("workbench").info(
        "serving %r: %d KV blocks of %d tokens (%d tokens, %.1f MiB, %s)",
        name,
        engine.runner.num_blocks,
        block_size,
        engine.runner.num_blocks * block_size,
        engine.runner.kv_bytes / 2**20,
        engine.runner.layout.stored_as(),
    )
    if engine.runner.compile_report:
        logging.getLogger("workbench").info(engine.runner.compile_report.line())
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=args.grace_period,
        log_level="info",
    )
    # uvicorn re-raises the SIGTERM it handled once it has shut down gracefully; with this no-op
    # handler in place the process then exits 0, as a finished graceful shutdown should.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.Server(config).run()
    return 0

"""`workbench serve`: flags for every engine and server setting, and the uvicorn run."""

from __future__ import annotations

import argparse
import json
import logging
import signal
from pathlib import Path

import torch
import uvicorn

from compress.artifact import MANIFEST
from serve.api_server import ServerSettings, build_app
from serve.async_engine import AsyncEngine
from serve.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.engine import InvalidRequest, LLMEngine
from serve.lora.adapter import AdapterError
from serve.lora.manager import LoraConfig
from serve.metrics import ServerMetrics


def _size(text: str) -> int:
    """Bytes from '512MiB', '2GiB', '1e9' or a plain integer."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    try:
        return int(float(lowered))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; use e.g. 512MiB, 2GiB or 1e9"
        ) from None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="variant dir, HF model dir, hub id, or demo / demo-tiny")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=8000, help="port to bind (default 8000; 0 = any free)"
    )
    p.add_argument(
        "--served-model-name",
        help="name clients send as `model` (default: the variant name or dir name)",
    )
    p.add_argument(
        "--api-key", help="require `Authorization: Bearer KEY` on every route but /health"
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="queued requests beyond which new ones get 503 + Retry-After",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_size,
        default=4 << 20,
        help="largest accepted request body (default 4MiB)",
    )
    p.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM",
    )
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=8, help="tokens per KV block (default 8)")
    g.add_argument(
        "--kv-cache-memory",
        type=_size,
        help="KV cache budget, e.g. 512MiB (default: 256MiB on the CPU, "
        "--kv-cache-fraction of free memory on a GPU)",
    )
    g.add_argument(
        "--kv-cache-fraction",
        type=float,
        default=0.5,
        help="fraction of free GPU memory for the KV cache when --kv-cache-memory is not given",
    )
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=1024,
        help="token budget per step; longer prompts are prefilled in chunks",
    )
    g.add_argument(
        "--max-model-len", type=int, default=2048, help="most tokens (prompt + output) per request"
    )
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not share KV blocks of common prompt prefixes",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda when available)")
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "sdpa", "reference"],
        help="paged attention implementation",
    )
    g.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="load this PEFT adapter at start (repeatable); clients select it with model=NAME",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        help="distinct adapters per step, i.e. device slots (turns LoRA serving on; 4 when only --lora is given)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="largest adapter rank served; slots are padded to it",
    )
    g.add_argument("--max-cpu-loras", type=int, default=16, help="adapters kept loaded on the host")
    g.add_argument(
        "--lora-root",
        type=Path,
        help="load adapters only from inside this directory (no .. or symlink escape)",
    )
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the sampler for requests without their own seed",
    )


def served_name(model: str) -> str:
    path = Path(model)
    manifest = path / MANIFEST
    if manifest.is_file():
        return json.loads(manifest.read_text()).get("variant") or path.name
    return path.name if path.exists() else model


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    if args.max_loras is None and not args.lora:
        return None
    return LoraConfig(args.max_loras or 4, args.max_lora_rank, args.max_cpu_loras)


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
    if args.threads:
        torch.set_num_threads(args.threads)
    loras = initial_loras(args)
    engine = LLMEngine(
        ModelConfig(args.model, args.dtype, args.device, args.attention_backend),
        CacheConfig(args.block_size, args.kv_cache_memory, args.kv_cache_fraction),
        SchedulerConfig(
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.max_model_len,
            not args.no_prefix_caching,
        ),
        seed=args.seed,
        lora=lora_config(args),
    )
    for name, path in loras:
        try:
            engine.load_lora(name, str(path))
        except (AdapterError, InvalidRequest) as e:
            raise SystemExit(f"--lora {name}={path}: {e}") from None
    return engine


def run_server(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    name = args.served_model_name or served_name(args.model)
    engine = build_engine(args)
    settings = ServerSettings(
        name, args.api_key, args.max_waiting, args.max_body_bytes, args.lora_root
    )
    app = build_app(AsyncEngine(engine, ServerMetrics(name)), settings)
    logging.getLogger("workbench").info(
        "serving %r: %d KV blocks of %d tokens (%d tokens, %.1f MiB)",
        name,
        engine.runner.num_blocks,
        args.block_size,
        engine.runner.num_blocks * args.block_size,
        engine.runner.kv_bytes / 2**20,
    )
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

"""`workbench serve` and `python -m serve`: flags for every engine and server setting, and the
uvicorn run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

import torch
import uvicorn

from compress.artifact import MANIFEST
from serve.api_server import ServerSettings, build_app
from serve.async_engine import AsyncEngine
from serve.config import ATTENTION_BACKENDS, CacheConfig, ModelConfig, SchedulerConfig
from serve.engine import InvalidRequest, LLMEngine
from serve.lora.adapter import AdapterError
from serve.lora.manager import LoraConfig
from serve.metrics import ServerMetrics


def _size(text: str) -> int:
    """Bytes from '512MiB', '2GiB', '1e9' or a plain integer (> 0)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
    units |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    lowered = text.strip().lower()
    number, factor = lowered, 1
    for unit, unit_factor in units.items():
        if lowered.endswith(unit):
            number, factor = lowered[: -len(unit)], unit_factor
            break
    try:
        value = int(float(number) * factor)
    except (ValueError, OverflowError):
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive size; use e.g. 512MiB, 2GiB or 1e9"
        )
    return value


API_KEY_ENV = "WORKBENCH_API_KEY"


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            allowed = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: {allowed}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: (0, 1]")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
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
        "--served-model-name",
        help="name clients send as `model` (default: the variant name or dir name)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help="require `Authorization: Bearer KEY` on every route but /health (default: "
        f"${API_KEY_ENV}; prefer the variable: a flag is visible to every user in `ps`)",
    )
    p.add_argument(
        "--max-waiting",
        type=int_in(1),
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
    g.add_argument(
        "--block-size", type=int_in(1, 1024), default=8, help="tokens per KV block (default 8)"
    )
    g.add_argument(
        "--kv-cache-memory",
        type=_size,
        help="KV cache budget, e.g. 512MiB (default: 256MiB on the CPU, "
        "--kv-cache-fraction of free memory on a GPU)",
    )
    g.add_argument(
        "--kv-cache-fraction",
        type=_fraction,
        default=0.5,
        help="fraction of free GPU memory for the KV cache when --kv-cache-memory is not given",
    )
    g.add_argument(
        "--max-num-seqs", type=int_in(1), default=64, help="most requests running at once"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int_in(1),
        default=1024,
        help="token budget per step; longer prompts are prefilled in chunks",
    )
    g.add_argument(
        "--max-model-len",
        type=int_in(1),
        help="most tokens (prompt + output) per request (default and maximum: the model's "
        "position limit)",
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
        choices=list(ATTENTION_BACKENDS),
        help="paged attention: paged-cpu (C kernel reading KV blocks in place; CPU, float32 "
        "or bfloat16, needs a C compiler), sdpa (gathered blocks, any device), reference "
        "(per-sequence loop); auto: paged-cpu where it runs, else sdpa",
    )
    g.add_argument("--threads", type=int_in(1), help="torch CPU threads (default: torch's choice)")
    g.add_argument(
        "--no-prepack-linears",
        action="store_true",
        help="on the CPU in float32/bfloat16, keep F.linear instead of oneDNN with prepacked weights",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="run each step through torch.compile (graphs built at load: seconds to minutes; "
        "float models without LoRA)",
    )
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
        type=int_in(1),
        help="distinct adapters per step, i.e. device slots (turns LoRA serving on; 4 when only --lora is given)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=int_in(1),
        default=16,
        help="largest adapter rank served; slots are padded to it",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int_in(1),
        default=16,
        help="adapters kept loaded on the host; loading one more is refused (409) unless the "
        'request says "evict": true',
    )
    g.add_argument(
        "--lora-root",
        type=Path,
        help="allow POST /v1/load_lora_adapter, from inside this directory only (no .. or "
        "symlink escape, for every file read)",
    )
    g.add_argument(
        "--allow-any-lora-path",
        action="store_true",
        help="allow POST /v1/load_lora_adapter from any path the server can read (without this "
        "or --lora-root, loading adapters over HTTP is refused)",
    )
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--seed",
        type=int_in(0, 2**64 - 1),
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
    """The engine the flags describe; a setting that cannot work exits with a one-line error."""
    if args.threads:
        torch.set_num_threads(args.threads)
    loras = initial_loras(args)
    if args.lora_root is not None and not args.lora_root.is_dir():
        raise SystemExit(f"--lora-root {args.lora_root}: no such directory")
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
        ModelConfig(
            args.model,
            args.dtype,
            args.device,
            args.attention_backend,
            prepack_linears=not args.no_prepack_linears,
            compile=args.compile,
        ),
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


def resolve_model_name(args: argparse.Namespace) -> None:
    """A built-in name (`demo`, `smollm2-135m`) or a `.gguf` file becomes its model dir, built
    or converted on first use, served under the name itself."""
    from catalog.names import named_model_dir

    model_dir = named_model_dir(args.model)
    if model_dir is not None:
        if not args.served_model_name:
            args.served_model_name = Path(args.model).stem
        args.model = str(model_dir)


def main(argv: list[str] | None = None) -> int:
    """`python -m serve MODEL [flags]`: the server without the rest of workbench."""
    parser = argparse.ArgumentParser(
        prog="python -m serve", description="Serve a model over an OpenAI-compatible HTTP API."
    )
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    resolve_model_name(args)
    return run_server(args)


def run_server(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    name = args.served_model_name or served_name(args.model)
    engine = build_engine(args)
    settings = ServerSettings(
        name,
        args.api_key or None,
        args.max_waiting,
        args.max_body_bytes,
        args.lora_root,
        args.allow_any_lora_path,
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

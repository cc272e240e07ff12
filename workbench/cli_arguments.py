"""The flags of `workbench run`, `export` and `dashboard` (`serve` and `bench` take theirs from
`serve.http.cli` and `evals.load_cli`)."""

from __future__ import annotations

import argparse

from compress.gguf_export import GGUF_TYPES
from compress.gguf_kquants import K_QUANTS
from serve.http.cli import int_in


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work-dir", help="where variants are written (default: runs/<recipe name>)")
    p.add_argument("--force", action="store_true", help="rebuild variants even when unchanged")
    p.add_argument(
        "--variant", action="append", metavar="NAME", help="only this variant (repeatable)"
    )
    p.add_argument(
        "--keep-checkpoints",
        type=int_in(1),
        default=1,
        metavar="N",
        help="training checkpoints kept per step while it trains (default 1: the newest, which "
        "an interrupted step resumes from; at least 1)",
    )
    p.add_argument(
        "--executor",
        choices=["local", "ray"],
        default="local",
        help="local: every task in this process, one after another (default); ray: each task "
        "a Ray task on a cluster (docs/cluster.md)",
    )
    p.add_argument(
        "--address",
        help="the Ray cluster to join: host:port of its head, or auto (default: RAY_ADDRESS, "
        "else a Ray instance on this machine)",
    )
    p.add_argument(
        "--storage",
        metavar="DIR|URL",
        help="the work dir every node mounts at this path, or an fsspec URL (s3://, gs://, ...) "
        "every node can write (default: the recipe's storage:, else runs/<recipe name>)",
    )
    p.add_argument(
        "--max-retries",
        type=int_in(0),
        default=3,
        metavar="N",
        help="with --executor ray: attempts after the first when a task's worker or node dies",
    )


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("variant", help="a variant dir, e.g. runs/<recipe>/variants/<name>")
    p.add_argument(
        "--format",
        required=True,
        help="hf (dense float weights), compressed-tensors (pack-quantized, or W8A8 for "
        "bnb-int8 with threshold 0: transformers, vLLM) or gguf (one file: llama.cpp, Ollama)",
    )
    p.add_argument(
        "--gguf-type",
        choices=[*GGUF_TYPES, *K_QUANTS],
        help="GGML type of a gguf export's weights (default: the variant's own: 4-bit -> q4_1, "
        "8-bit -> q8_0, float -> its dtype; an adapter's GGUF LoRA: f32, or f16, bf16, q8_0); "
        "the K-quants (q4_k_m, ...) are written by llama.cpp's quantizer",
    )
    p.add_argument(
        "--llama-quantize",
        metavar="PATH",
        help="llama.cpp's quantizer for K-quant types: a llama-quantize binary, or a Python with "
        "llama-cpp-python (default: $WORKBENCH_LLAMA_QUANTIZE, else llama-quantize on PATH)",
    )
    p.add_argument(
        "--out", help="the dir to write (default: runs/<recipe>/exports/<name>-<format>)"
    )


def add_dashboard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("reports", nargs="?", default="reports", help="reports dir (default reports/)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8050, help="port to bind (default 8050)")
    p.add_argument(
        "--allowed-hosts",
        help="comma-separated Host names answered besides the loopback ones on a loopback "
        "address (a DNS-rebinding guard), e.g. the name a proxy forwards; * for any",
    )
    p.add_argument(
        "--allowed-origins",
        help="comma-separated browser origins allowed to call the dashboard's API, or * for any",
    )

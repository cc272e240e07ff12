"""What the reference checks (`benchmarks/*_reference.py`) share: their command line, the float
model with its calibration windows, and the JSON they write."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.step_bench import resolve_model
from catalog.data import NAMED
from compress.calibration import CalibrationParams, calibration_rows


def parser(doc: str | None, reference_help: str, samples: int, out: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--reference", required=True, type=Path, help=reference_help)
    p.add_argument("--model", default="gemma3-270m", help="built-in name or model dir")
    p.add_argument("--layers", default="0,8,17", help="decoder layer indices")
    p.add_argument("--samples", type=int, default=samples)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--out", default=out)
    return p


def float_model_and_rows(args: argparse.Namespace) -> tuple[Path, Any, torch.Tensor]:
    """The model (float32) and `--samples` seeded calibration windows of the stdlib corpus."""
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = CalibrationParams(samples=args.samples, seq_len=args.seq_len)
    return model_dir, model, calibration_rows(tokenizer, params, NAMED, 0).rows


def write(out: str, record: dict[str, Any]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")

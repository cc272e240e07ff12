"""Does vLLM run our compressed-tensors exports as the workbench runs the variants? (issue 24)

`python -m benchmarks.vllm_export_check VARIANT_DIR... [--out DIR] [--windows 8] [--seq-len 128]
[--vllm-venv .vllm-venv] [--dtype float32]`: for each variant (a packed one, or bnb-int8 with
threshold 0: W8A8), exports it as compressed-tensors into OUT/<name>-ct (kept for a rerun), cuts
held-out windows of the demo corpus's validation split with its tokenizer, and scores them three
ways: the variant as the evals load it, transformers on the export, and vLLM's offline engine on
the export (in its own venv, `benchmarks/vllm_worker.py`, prompt logprobs). Prints per route the
perplexity, and vLLM's perplexity over the variant's with its top-1 agreement with the variant
(the share of positions whose most likely token is the same) and with transformers on the export.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from benchmarks.vllm_system import VllmWorker
from compress.artifact import artifact_from_manifest
from compress.export import export
from compress.load_spec import load_model
from evals.artifact_eval import load_for_eval
from evals.gguf_check import held_out_windows

Scores = dict[str, list]


@torch.inference_mode()
def score(model: torch.nn.Module, windows: list[list[int]]) -> Scores:
    """Per window: mean NLL (nats) of tokens 2.., and the argmax at positions 1.."""
    nll, top1 = [], []
    for ids in windows:
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
        lp = logits.log_softmax(-1)
        nll.append(float(-lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()))
        top1.append(logits.argmax(-1).tolist())
    return {"nll": nll, "top1": top1}


def perplexity(s: Scores) -> float:
    return math.exp(sum(s["nll"]) / len(s["nll"]))


def agreement(a: Scores, b: Scores) -> float:
    pairs = [(x, y) for wa, wb in zip(a["top1"], b["top1"]) for x, y in zip(wa, wb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def check(variant: Path, out: Path, args: argparse.Namespace) -> dict[str, float | str]:
    from transformers import AutoTokenizer

    exported = out / f"{variant.name}-ct"
    if not (exported / "config.json").is_file():
        info = export(variant, "compressed-tensors", exported)
        print(
            f"{variant.name}: exported ({', '.join(info['schemes'])}, {info['bytes'] / 1e6:.0f} MB)"
        )
    windows = held_out_windows(AutoTokenizer.from_pretrained(variant), args.windows, args.seq_len)
    ours = score(load_for_eval(artifact_from_manifest(variant)), windows)
    via_transformers = score(load_model(exported), windows)
    worker = VllmWorker(
        args.vllm_venv, exported, out / f"{variant.name}-vllm.log", dtype=args.dtype
    )
    with worker:
        vllm = worker.score(windows)
    quant = json.loads((exported / "config.json").read_text())["quantization_config"]
    return {
        "variant": variant.name,
        "format": quant["format"],
        "vllm": worker.version,
        "ppl_variant": perplexity(ours),
        "ppl_transformers_export": perplexity(via_transformers),
        "ppl_vllm_export": perplexity(vllm),
        "vllm_over_variant": perplexity(vllm) / perplexity(ours),
        "top1_vllm_vs_variant": agreement(vllm, ours),
        "top1_transformers_vs_variant": agreement(via_transformers, ours),
        "top1_vllm_vs_transformers": agreement(vllm, via_transformers),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("variants", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=Path("/tmp/vllm-export-check"))
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vllm-venv", type=Path, default=Path(".vllm-venv"))
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [check(v, args.out, args) for v in args.variants]
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['variant']} ({r['format']}, vLLM {r['vllm']}): perplexity {r['ppl_variant']:.3f} "
            f"(variant) / {r['ppl_transformers_export']:.3f} (transformers, export) / "
            f"{r['ppl_vllm_export']:.3f} (vLLM, export): vLLM x{r['vllm_over_variant']:.4f} of "
            f"the variant, top-1 agreement {r['top1_vllm_vs_variant']:.1%} (transformers on "
            f"the export: {r['top1_transformers_vs_variant']:.1%}; vLLM against it: "
            f"{r['top1_vllm_vs_transformers']:.1%})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does vLLM run our compressed-tensors exports as the workbench runs the variants? (issue 24)

`python -m benchmarks.vllm_export_check VARIANT_DIR... [--out DIR] [--windows 8] [--seq-len 128]
[--vllm-venv .vllm-venv] [--dtype float32 | bfloat16]`: for each variant (a packed one, or
bnb-int8 with threshold 0: W8A8), exports it as compressed-tensors into OUT/<name>-ct (kept for a
rerun), cuts held-out windows of the demo corpus's validation split with its tokenizer, and
scores them three ways: the variant as the evals load it, transformers on the export, and vLLM's
offline engine on the export (in its own venv, `benchmarks/vllm_worker.py`, prompt logprobs).
Prints per route the perplexity, and vLLM's perplexity over the variant's with its top-1
agreement with the variant (the share of positions whose most likely token is the same) and with
transformers on the export. Then asks 16 chat prompts (as plain text to a base model) greedily
of vLLM on the export and of this engine on the variant: answers identical, tokens in common,
the largest logprob difference of a token both chose in the same context; and what vLLM's log
says (the kernel per scheme, checkpoint size, KV cache).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from benchmarks.vllm_system import VllmWorker
from compress.artifact import artifact_from_manifest
from compress.export import export
from compress.load_model import load_model
from evals import gguf_check
from evals.artifact_eval import load_for_eval

Scores = dict[str, list]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Give me three tips for learning a new language.",
    "Explain what a hash table is to a ten-year-old.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I reverse a list in Python?",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a coffee shop by the sea.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "What are the three states of matter?",
    "Write a haiku about autumn leaves.",
    "How many minutes are there in a day?",
    "What should I pack for a weekend hiking trip?",
    "Describe a cat to someone who has never seen one.",
]
"""16 chat prompts, asked greedily of both engines (32 tokens each, end-of-sequence ignored)."""
ANSWER_TOKENS = 32
LOG_FACTS = {
    "kernel": re.compile(r"(?:Selected|Using) (\S+Kernel) for (CompressedTensors\S+)"),
    "checkpoint_gib": re.compile(r"Checkpoint size: ([0-9.]+) GiB"),
    "kv_cache_tokens": re.compile(r"CPU KV cache size: ([0-9,]+) tokens"),
}
"""What vLLM's log says of the export: the kernel it chose per scheme, the checkpoint's size on
disk (its CPU build logs no weight memory) and the KV cache it allotted."""


def score(model: torch.nn.Module, windows: list[list[int]]) -> Scores:
    """Per window: mean NLL (nats) of tokens 2.., and the argmax at positions 1.."""
    nll, top1, _ = gguf_check.score(model, windows)
    return {"nll": nll, "top1": top1}


def perplexity(s: Scores) -> float:
    return math.exp(sum(s["nll"]) / len(s["nll"]))


def agreement(a: Scores, b: Scores) -> float:
    pairs = [(x, y) for wa, wb in zip(a["top1"], b["top1"]) for x, y in zip(wa, wb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    """The prompts in the model's chat template; as plain text for a base model (none)."""
    if tokenizer.chat_template is None:
        return [tokenizer(p).input_ids for p in CHAT_PROMPTS]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for p in CHAT_PROMPTS
    ]


def engine_answers(
    variant: Path, prompts: list[list[int]], dtype: str
) -> list[tuple[list[int], list[float]]]:
    """This engine's greedy answers on the variant: (token ids, each chosen token's logprob)."""
    from serve import LLM, SamplingParams

    llm = LLM(str(variant), dtype=dtype)
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    return [
        (c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)])
        for c in llm.generate(prompts, params)
    ]


def compare_answers(
    ours: list[tuple[list[int], list[float]]], theirs: list[tuple[list[int], list[float]]]
) -> dict[str, float]:
    """Prompts answered identically; mean length of the common start; the largest difference
    of a chosen token's logprob over the common starts (same context, same token)."""
    same, common, largest = 0, [], 0.0
    for (ids_a, lp_a), (ids_b, lp_b) in zip(ours, theirs):
        n = next((i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b), len(ids_a))
        same += ids_a == ids_b
        common.append(n)
        largest = max([largest, *(abs(a - b) for a, b in zip(lp_a[:n], lp_b[:n]))])
    return {
        "answers_identical": same,
        "answers": len(ours),
        "common_start_tokens": sum(common) / len(common),
        "largest_logprob_difference": largest,
    }


def log_facts(log: Path) -> dict[str, str]:
    text = log.read_text(errors="replace")
    facts = {}
    for name, pattern in LOG_FACTS.items():
        found = pattern.search(text)
        if found:
            facts[name] = " for ".join(found.groups())
    return facts


def check(variant: Path, out: Path, args: argparse.Namespace) -> dict[str, object]:
    from transformers import AutoTokenizer

    exported = out / f"{variant.name}-ct"
    if not (exported / "config.json").is_file():
        info = export(variant, "compressed-tensors", exported)
        print(
            f"{variant.name}: exported ({', '.join(info['schemes'])}, {info['bytes'] / 1e6:.0f} MB)"
        )
    tokenizer = AutoTokenizer.from_pretrained(variant)
    windows = gguf_check.held_out_windows(tokenizer, args.windows, args.seq_len)
    dtype = getattr(torch, args.dtype)
    ours = score(load_for_eval(artifact_from_manifest(variant), dtype), windows)
    via_transformers = score(load_model(exported, dtype=dtype), windows)
    prompts = chat_prompts(tokenizer)
    our_answers = engine_answers(variant, prompts, args.dtype)
    log = out / f"{variant.name}-vllm.log"
    worker = VllmWorker(args.vllm_venv, exported, log, dtype=args.dtype)
    with worker:
        vllm = worker.score(windows)
        answered = worker.generate(prompts, [ANSWER_TOKENS] * len(prompts), logprobs=True)
    assert answered.logprobs is not None
    quant = json.loads((exported / "config.json").read_text())["quantization_config"]
    return {
        "variant": variant.name,
        "format": quant["format"],
        "vllm": worker.version,
        **log_facts(log),
        **compare_answers(our_answers, list(zip(answered.outputs, answered.logprobs))),
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
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="every route's dtype (vLLM's CPU 4-bit kernel takes bfloat16 only)",
    )
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
        print(
            f"  greedy answers to {r['answers']} chat prompts ({ANSWER_TOKENS} tokens): "
            f"{r['answers_identical']} identical to this engine's on the variant, "
            f"{r['common_start_tokens']:.1f} tokens in common on average; largest difference of "
            f"a chosen token's logprob over the common starts {r['largest_logprob_difference']:.4f}"
        )
        print(
            f"  vLLM's log: {r.get('kernel', '?')}; checkpoint {r.get('checkpoint_gib', '?')} "
            f"GiB; KV cache {r.get('kv_cache_tokens', '?')} tokens"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

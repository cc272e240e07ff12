"""Does llama.cpp run our GGUF exports as the workbench runs the variants? (issue 24's check)

`python -m evals.gguf_check prepare DIR VARIANT_DIR... [--windows 8] [--seq-len 128]`: exports
each variant as GGUF (its own default type; `--gguf-type T [--llama-quantize Q]`: every model
variant in T, into DIR/<name>-<T>/) into DIR/<name>/, cuts held-out windows of the demo
corpus's validation split with the variant's tokenizer, and stores per window the variant's mean
NLL (transformers on the variant, as the evals load it) and the GGUF export's (transformers'
GGUF loader), plus the variant's logits on the first windows. An adapter variant exports as its
base's GGUF (float32) plus the adapter's GGUF LoRA (`adapter.gguf`), which llama.cpp applies
(`--lora`); transformers has no GGUF LoRA loader, so that route is left out for it.
`python benchmarks/llama_cpp_score.py DIR` (llama.cpp's venv) scores the same windows.
`python -m evals.gguf_check compare DIR` prints per variant: perplexity through each route,
llama.cpp's perplexity over the variant's, KL(variant || llama.cpp), top-1 agreement, and how
many texts llama.cpp tokenizes into the variant's own ids (the windows are given as ids, so
only this shows what a user typing text gets).
`benchmarks/llama_cpp_check.sh` runs all three.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from catalog.data import NAMED
from compress.artifact import artifact_from_manifest
from compress.export import export
from compress.gguf_export import GGUF_FILE
from evals.artifact_eval import load_for_eval

KEPT_LOGITS = 4
"""Windows whose full logits are kept for the KL (a 49k vocabulary: 25 MB per window pair)."""


TRICKY_TEXTS = [
    "In 2024, 12345 items cost $3.50.",
    "It's what they'll've done; HELLO'S World's",
    "def f(x):\n    return x**2  # squared\n\n\n",
    "  leading spaces and\ttabs\r\n",
    "Ünïcödé café naïve 東京 🙂 3.14159 and 1,000,000",
]
"""Strings whose splitting depends on the pre-tokenizer's regex (contractions, digits, runs of
spaces and newlines, non-ASCII)."""


def corpus_texts() -> list[str]:
    return [json.loads(line)["text"] for line in NAMED["corpus"]()["validation"].open()]


def tokenization_cases(tokenizer: object, count: int = 32) -> list[tuple[str, list[int]]]:
    """Texts (the tricky strings, then held-out corpus texts) and the variant's token ids for
    them, without special tokens: llama.cpp must cut the same text into the same ids."""
    texts = TRICKY_TEXTS + [t[:2000] for t in corpus_texts()[:count]]
    return [(t, tokenizer(t, add_special_tokens=False).input_ids) for t in texts]  # type: ignore[operator]


def held_out_windows(tokenizer: object, count: int, seq_len: int) -> list[list[int]]:
    texts = corpus_texts()
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text).input_ids  # type: ignore[operator]
        if len(ids) >= count * seq_len:
            break
    return [ids[i * seq_len : (i + 1) * seq_len] for i in range(count)]


@torch.inference_mode()
def score(
    model: torch.nn.Module, windows: list[list[int]]
) -> tuple[list[float], list[list[int]], np.ndarray]:
    """Per window: mean NLL (nats) of tokens 2.. and the most likely token at positions 1..;
    and the first windows' logits (float16)."""
    nll, top1, kept = [], [], []
    for i, ids in enumerate(windows):
        logits = model(torch.tensor([ids])).logits[0].float()
        lp = logits[:-1].log_softmax(-1)
        nll.append(float(-lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()))
        top1.append(logits[:-1].argmax(-1).tolist())
        if i < KEPT_LOGITS:
            kept.append(logits.half().numpy())
    return nll, top1, np.stack(kept)


def prepare(
    out: Path,
    variants: list[Path],
    count: int,
    seq_len: int,
    gguf_type: str | None = None,
    llama_quantize: str | None = None,
) -> None:
    """`gguf_type`: export every (model) variant in this GGML type instead of its own, into
    DIR/<name>-<type>/ (a K-quant: through `llama_quantize`, `compress.gguf_kquants`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(variants[0])
    windows = held_out_windows(tokenizer, count, seq_len)
    texts = tokenization_cases(tokenizer)
    (out / "windows.json").write_text(json.dumps({"windows": windows, "texts": texts}))
    for variant in variants:
        adapter = (variant / "adapter_config.json").is_file()
        typed = gguf_type if gguf_type and not adapter else None
        folder = out / (f"{variant.name}-{typed}" if typed else variant.name)
        if not (folder / "export.json").is_file():
            info = (
                _export_adapter(variant, folder)
                if adapter
                else export(variant, "gguf", folder, typed, llama_quantize)
            )
            (folder / "export.json").write_text(json.dumps(info))
            print(f"{variant.name}: exported {info['gguf_type']} ({info['bytes'] / 1e6:.0f} MB)")
        gguf_type = json.loads((folder / "export.json").read_text())["gguf_type"]
        ours, _, logits = score(load_for_eval(artifact_from_manifest(variant)), windows)
        via_gguf = None
        if not adapter:
            imported = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE).eval()
            via_gguf, _, _ = score(imported, windows)
        np.save(folder / "ours_logits.npy", logits)
        record = {"nll": ours, "gguf_nll": via_gguf, "gguf_type": gguf_type}
        (folder / "ours.json").write_text(json.dumps(record))
        print(f"{variant.name}: scored {len(windows)} windows (variant, transformers GGUF import)")


def _export_adapter(variant: Path, folder: Path) -> dict:
    """The adapter's GGUF LoRA beside its base's float32 GGUF, in `folder`."""
    from compress.gguf_lora import LORA_FILE

    lora = export(variant, "gguf", folder / "lora")
    base = export(Path(lora["base"]), "gguf", folder / "base", "f32")
    (folder / "lora" / LORA_FILE).rename(folder / LORA_FILE)
    (folder / "base" / GGUF_FILE).rename(folder / GGUF_FILE)
    for sub in ("lora", "base"):
        (folder / sub).rmdir()
    return {**lora, "bytes": lora["bytes"] + base["bytes"], "gguf_type": "f32 base + f32 LoRA"}


def compare(out: Path) -> None:
    windows = json.loads((out / "windows.json").read_text())["windows"]
    print(
        "| variant | GGUF type | GGUF MB | ppl variant | ppl GGUF (transformers) | ppl GGUF "
        "(llama.cpp) | llama.cpp / transformers, same file | llama.cpp / variant | "
        "KL(variant ‖ llama.cpp) | top-1 agreement | texts tokenized alike |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for folder in sorted(p for p in out.iterdir() if (p / "llama.json").is_file()):
        ours = json.loads((folder / "ours.json").read_text())
        llama = json.loads((folder / "llama.json").read_text())
        p_ours, p_llama = (math.exp(sum(x) / len(x)) for x in (ours["nll"], llama["nll"]))
        via = ours["gguf_nll"]
        p_gguf = math.exp(sum(via) / len(via)) if via else None
        same_file = f"{p_llama / p_gguf:.4f}" if p_gguf else "n/a"
        a = np.load(folder / "ours_logits.npy").astype(np.float32)[:, :-1]
        b = np.load(folder / "llama_logits.npy").astype(np.float32)[:, :-1]
        la = torch.from_numpy(a).log_softmax(-1)
        lb = torch.from_numpy(b).log_softmax(-1)
        kl = float((la.exp() * (la - lb)).sum(-1).mean())
        agree = float(
            (torch.from_numpy(a).argmax(-1) == torch.from_numpy(b).argmax(-1)).float().mean()
        )
        size = (folder / GGUF_FILE).stat().st_size / 1e6
        print(
            f"| {folder.name} | {ours['gguf_type']} | {size:.0f} | {p_ours:.3f} | "
            f"{f'{p_gguf:.3f}' if p_gguf else 'n/a (a GGUF LoRA)'} | {p_llama:.3f} | "
            f"{same_file} | {p_llama / p_ours:.4f} | {kl:.4f} | {agree:.1%} | {_alike(llama)} |"
        )
    print(
        f"({len(windows)} windows of {len(windows[0])} tokens; KL and agreement on the first "
        f"{KEPT_LOGITS})"
    )


def _alike(llama: dict) -> str:
    """How many texts llama.cpp cut into the variant's ids, with the GGUF's pre-tokenizer."""
    texts = llama.get("texts_alike")
    return f"{texts[0]} / {texts[1]} ({llama.get('pre')})" if texts else "not checked"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("out", type=Path)
    p.add_argument("variants", type=Path, nargs="+")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--gguf-type", help="export the model variants in this GGML type")
    p.add_argument("--llama-quantize", help="llama.cpp's quantizer, for K-quant types")
    p = sub.add_parser("compare")
    p.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(
            args.out, args.variants, args.windows, args.seq_len, args.gguf_type, args.llama_quantize
        )
    else:
        compare(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

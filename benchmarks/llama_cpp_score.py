"""Score token windows with llama.cpp (llama-cpp-python), in its own venv: numpy and llama_cpp
only, no workbench import.

usage: python benchmarks/llama_cpp_score.py DIR
DIR holds windows.json ({"windows": [[token ids], ...]}) and one folder per variant with
model.gguf (and, for an adapter variant, adapter.gguf: the GGUF LoRA applied to model.gguf);
writes llama.json (per-window mean NLL in nats, top-1 predictions, how many of the
texts llama.cpp tokenizes into the given ids, the GGUF's pre-tokenizer name) and
llama_logits.npy (float16 logits of the first windows, as many as ours_logits.npy holds) into
each variant's folder.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from llama_cpp import Llama


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> int:
    root = Path(sys.argv[1])
    held_out = json.loads((root / "windows.json").read_text())
    windows, texts = held_out["windows"], held_out.get("texts", [])
    for folder in sorted(p for p in root.iterdir() if (p / "model.gguf").is_file()):
        kept = np.load(folder / "ours_logits.npy").shape[0]
        started = time.perf_counter()
        lora = folder / "adapter.gguf"
        llm = Llama(
            str(folder / "model.gguf"),
            lora_path=str(lora) if lora.is_file() else None,
            n_ctx=max(len(w) for w in windows) + 8,
            n_batch=512,
            logits_all=True,
            verbose=False,
        )
        loaded = time.perf_counter() - started
        nll, top1, logits = [], [], []
        for i, ids in enumerate(windows):
            llm.reset()
            llm.eval(ids)
            scores = np.array(llm.scores[: len(ids)], dtype=np.float32)
            lp = log_softmax(scores[:-1])
            nll.append(float(-lp[np.arange(len(ids) - 1), ids[1:]].mean()))
            top1.append(scores[:-1].argmax(-1).tolist())
            if i < kept:
                logits.append(scores.astype(np.float16))
        np.save(folder / "llama_logits.npy", np.stack(logits))
        alike = sum(
            llm.tokenize(t.encode(), add_bos=False, special=False) == ids for t, ids in texts
        )
        pre = llm.metadata.get("tokenizer.ggml.pre")
        (folder / "llama.json").write_text(
            json.dumps(
                {"nll": nll, "top1": top1, "load_s": loaded, "engine": "llama.cpp",
                 "texts_alike": [alike, len(texts)], "pre": pre}
            )
        )  # fmt: skip
        print(f"{folder.name}: llama.cpp loaded in {loaded:.1f} s, scored {len(windows)} windows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

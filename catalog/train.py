"""Train the offline demo model: a small Llama (GQA) on the stdlib corpus, from a fixed seed.

Model: tokenize each split with documents joined by `<|eos|>`, cut the stream into rows of
`seq_len` tokens, and train a `LlamaForCausalLM` with AdamW (linear warm-up, cosine decay) on rows
drawn in a seeded order. The whole build is a pure function of the `DemoSpec`: same spec, same
tokenizer bytes, same first-batch loss, same weights (on the same torch build).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from catalog import corpus, shifted
from catalog.tokenizer import train_tokenizer
from compress.artifact import BUILD_RECORD_SUFFIX
from compress.data import perplexity, token_rows

BUILD_INFO = f"demo{BUILD_RECORD_SUFFIX}"


@dataclass(frozen=True)
class DemoSpec:
    """Everything that determines a demo model; its hash names the cache entry."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    seed: int = 0
    max_train_chars: int | None = None
    """Use only the first this-many characters of the train split (the tiny spec does)."""
    warmup_steps: int = 20


SPECS: dict[str, DemoSpec] = {
    "demo": DemoSpec(
        vocab_size=4096,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
        seq_len=128,
        batch_size=32,
        steps=540,
        lr=4e-3,
    ),
    "demo-tiny": DemoSpec(
        vocab_size=512,
        hidden_size=64,  # bitsandbytes' 4-bit CPU kernels need in_features divisible by 64
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        seq_len=64,
        batch_size=8,
        steps=120,
        lr=3e-3,
        max_train_chars=200_000,
        warmup_steps=5,
    ),
}


def _llama_config(spec: DemoSpec, tok: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def _lr_at(spec: DemoSpec, step: int) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def unigram_perplexity(train: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> float:
    """The baseline: token frequencies of the train rows (add-one), scored like `perplexity`."""
    counts = torch.bincount(train.reshape(-1), minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return math.exp(-logp[rows[:, 1:].reshape(-1)].mean().item())


def _train(spec: DemoSpec, model: LlamaForCausalLM, rows: torch.Tensor) -> list[float]:
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01, betas=(0.9, 0.95))
    order = torch.randperm(len(rows), generator=gen)
    losses = []
    model.train()
    for step in tqdm(range(spec.steps), desc="training demo model", unit="step", leave=False):
        idx = [order[(step * spec.batch_size + j) % len(order)] for j in range(spec.batch_size)]
        batch = rows[torch.stack(idx)]
        for group in opt.param_groups:
            group["lr"] = _lr_at(spec, step)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def build(spec: DemoSpec, out_dir: Path) -> dict[str, object]:
    """Train tokenizer and model, save both to `out_dir` with a build report; return the report."""
    start = time.perf_counter()
    torch.manual_seed(spec.seed)
    texts = corpus.split_texts(corpus.load_documents())
    train_texts = texts["train"]
    if spec.max_train_chars is not None:
        train_texts = _first_chars(train_texts, spec.max_train_chars)
    tok = train_tokenizer(train_texts, spec.vocab_size)
    train_rows = token_rows(tok, train_texts, spec.seq_len)
    model = LlamaForCausalLM(_llama_config(spec, tok))
    losses = _train(spec, model, train_rows)
    val_rows = token_rows(tok, texts["validation"], spec.seq_len)
    shifted_rows = token_rows(tok, shifted.documents("validation"), spec.seq_len)
    report = {
        "spec": dataclasses.asdict(spec),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": train_rows.numel(),
        "first_batch_loss": losses[0],
        "final_train_loss": losses[-1],
        "validation_perplexity": perplexity(model, val_rows),
        "unigram_validation_perplexity": unigram_perplexity(train_rows, val_rows, len(tok)),
        "shifted_validation_perplexity": perplexity(model, shifted_rows),
        "build_seconds": round(time.perf_counter() - start, 2),
        "torch": torch.__version__,
    }
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    (out_dir / BUILD_INFO).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _first_chars(texts: list[str], limit: int) -> list[str]:
    out, used = [], 0
    for t in texts:
        if used >= limit:
            break
        out.append(t[: limit - used])
        used += len(out[-1])
    return out

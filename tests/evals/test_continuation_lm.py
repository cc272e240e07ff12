"""`ContinuationLM` scores as lm-eval's HFLM does (same log-likelihoods, same greedy flags), on a
Llama and on a Gemma 3 with logit softcapping, for shared contexts, one-token answers, windows cut
by `max_length` and rolling perplexity; and through lm-eval's own task run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, LlamaConfig

from evals import continuation_lm
from evals.continuation_lm import ContinuationLM
from evals.quality import TaskRequest, run_tasks

MAX_LENGTH = 48


def _model(arch: str, vocab: int) -> torch.nn.Module:
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    if arch == "gemma3":
        config = Gemma3TextConfig(
            **common,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=3.0,
        )
    else:
        config = LlamaConfig(**common)
    return AutoModelForCausalLM.from_config(config).eval()


def _requests(vocab: int) -> list[tuple[None, list[int], list[int]]]:
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    shared = tokens(20)
    out: list[tuple[None, list[int], list[int]]] = [(None, shared, tokens(k)) for k in (1, 4, 9)]
    question = tokens(12)
    out += [(None, question, [t]) for t in tokens(3)]  # three one-token answers: one window
    out += [(None, tokens(MAX_LENGTH + 30), tokens(6))]  # the context is cut on the left
    out += [(None, tokens(rng.randint(1, 40)), tokens(rng.randint(1, 7))) for _ in range(20)]
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_loglikelihoods_equal_hflms(arch: str, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = _model(arch, len(tokenizer))
    ours = ContinuationLM(
        pretrained=model, tokenizer=tokenizer, batch_size=4, max_length=MAX_LENGTH
    )
    theirs = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, max_length=MAX_LENGTH)
    requests = _requests(len(tokenizer))
    prompt = requests[0][1]
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[0]
    requests.append((None, prompt, greedy[len(prompt) :].tolist()))  # the argmax at every step
    got = ours._loglikelihood_tokens(requests, disable_tqdm=True)
    want = theirs._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in want]
    assert got[-1][1] and not all(g for _, g in got)
    assert [s for s, _ in got] == pytest.approx([s for s, _ in want], abs=1e-4)

    text = " ".join(str(i) for i in range(200))
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    assert ours.loglikelihood_rolling(rolling, disable_tqdm=True) == pytest.approx(
        theirs.loglikelihood_rolling(rolling, disable_tqdm=True), abs=1e-3
    )


def test_a_forward_projects_at_most_the_position_budget(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = _model("llama", len(tokenizer))
    monkeypatch.setattr(continuation_lm, "POSITIONS_PER_FORWARD", 10)
    widths: list[int] = []
    model.get_output_embeddings().register_forward_hook(
        lambda m, a, out: widths.append(out.shape[1])
    )
    lm = ContinuationLM(pretrained=model, tokenizer=tokenizer, batch_size=64, max_length=MAX_LENGTH)
    requests = _requests(len(tokenizer))
    lm._loglikelihood_tokens(requests, disable_tqdm=True)
    windows, scored = lm._plan(requests)
    assert len(windows) == len(requests) - 2  # the three one-token answers share a window
    assert max(widths) <= 10 and len(widths) > 10
    assert sum(widths) == len({(s.row, s.start + k) for s in scored for k in range(len(s.targets))})


def test_a_task_run_logs_the_same_answers_as_hflm(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tasks = [TaskRequest("arc_easy", limit=5), TaskRequest("piqa", limit=4)]
    runs = [
        run_tasks(
            cls(pretrained=model, tokenizer=tokenizer, batch_size=8, max_length=256),
            None,
            tasks,
            None,
            True,
        )
        for cls in (ContinuationLM, HFLM)
    ]
    for task in ("arc_easy", "piqa"):
        ours, theirs = (sorted(r["samples"][task], key=lambda s: s["doc_id"]) for r in runs)
        assert [s["acc_norm"] for s in ours] == [s["acc_norm"] for s in theirs]
        for a, b in zip(ours, theirs, strict=True):
            assert [r[0][0] for r in a["resps"]] == pytest.approx(
                [r[0][0] for r in b["resps"]], abs=1e-4
            )

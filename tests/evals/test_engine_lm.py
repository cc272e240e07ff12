"""lm-eval through the engine (`EngineLM`) scores as HFLM does on the same model: the same
log-likelihoods within 1e-4 nats and the same greedy flags, shared contexts read from the prefix
cache, rolling perplexity, greedy generation equal to `generate`, and a task run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import AutoModelForCausalLM, AutoTokenizer

from evals.engine_lm import EngineLM, sharing_waves
from evals.quality import TaskRequest, run_tasks
from tests.evals.test_continuation_lm import _requests

MAX_LENGTH = 48


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> tuple[EngineLM, HFLM]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = EngineLM(tiny_model_dir, max_length=MAX_LENGTH, max_num_batched_tokens=64)
    return ours, HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, max_length=MAX_LENGTH)


def test_loglikelihoods_equal_hflms_and_contexts_come_from_the_prefix_cache(
    pair: tuple[EngineLM, HFLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, theirs = pair
    requests = _requests(len(ours.tokenizer))
    shared = requests[0][1]
    greedy = theirs.model.generate(torch.tensor([shared]), max_new_tokens=4, do_sample=False)[0]
    requests.append((None, shared, greedy[len(shared) :].tolist()))
    cached: list[int] = []
    generate = ours.llm.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        outs = generate(*args, **kwargs)
        cached.extend(o.num_cached_tokens for o in outs)
        return outs

    monkeypatch.setattr(ours.llm, "generate", spy)
    got = ours._loglikelihood_tokens(requests, disable_tqdm=True)
    want = theirs._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in want] and got[-1][1]
    assert [s for s, _ in got] == pytest.approx([s for s, _ in want], abs=1e-4)
    # the second wave (requests whose context a first-wave request computed) hit the cache
    assert sum(1 for c in cached if c > 0) >= 2


def test_an_int8_kv_cache_scores_as_hflm_attending_over_int8_rounded_keys_and_values(
    pair: tuple[EngineLM, HFLM], tiny_model_dir: Path
) -> None:
    """`kv_cache_dtype=int8` (a `serve: {kv_cache_dtype: int8}` variant under `backend: engine`)
    scores what HFLM scores over `evals.int8_kv`'s attention, which the HF backend uses for it;
    the rounding moves the scores off the float ones."""
    from evals.int8_kv import with_kv_cache_dtype

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rounded = HFLM(
        pretrained=with_kv_cache_dtype(model, "int8"),
        tokenizer=tokenizer,
        batch_size=4,
        max_length=MAX_LENGTH,
    )
    ours = EngineLM(
        tiny_model_dir, max_length=MAX_LENGTH, max_num_batched_tokens=64, kv_cache_dtype="int8"
    )
    requests = _requests(len(ours.tokenizer))
    got = ours._loglikelihood_tokens(requests, disable_tqdm=True)
    want = rounded._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in want]
    assert [s for s, _ in got] == pytest.approx([s for s, _ in want], abs=1e-4)
    plain = pair[1]._loglikelihood_tokens(requests, disable_tqdm=True)
    assert max(abs(s - p) for (s, _), (p, _) in zip(got, plain, strict=True)) > 1e-3


def test_rolling_loglikelihood_equals_hflms(pair: tuple[EngineLM, HFLM]) -> None:
    ours, theirs = pair
    text = " ".join(f"word{i}" for i in range(120))
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    assert ours.loglikelihood_rolling(rolling, disable_tqdm=True) == pytest.approx(
        theirs.loglikelihood_rolling(rolling, disable_tqdm=True), abs=1e-3
    )


def test_greedy_generation_equals_generate_and_stops_at_until(pair: tuple[EngineLM, HFLM]) -> None:
    ours, theirs = pair
    context = "def add(a, b):"
    ids = ours.tok_encode(context)
    expected = theirs.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0]
    text = ours.tok_decode(expected[len(ids) :].tolist())
    request = Instance("generate_until", {}, (context, {"until": [], "max_gen_toks": 12}), 0)
    assert ours.generate_until([request], disable_tqdm=True) == [text]
    stop = text[3:5]  # a stop string inside the greedy text: the text ends before it
    request = Instance("generate_until", {}, (context, {"until": [stop], "max_gen_toks": 12}), 0)
    (cut,) = ours.generate_until([request], disable_tqdm=True)
    assert cut == text[: text.index(stop)]


def test_a_task_run_logs_the_same_answers_as_hflm(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ours = EngineLM(tiny_model_dir, max_length=256)
    theirs = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8, max_length=256)
    tasks = [TaskRequest("arc_easy", limit=5), TaskRequest("hellaswag", limit=3)]
    runs = [run_tasks(lm, None, tasks, None, True) for lm in (ours, theirs)]
    for task in ("arc_easy", "hellaswag"):
        a, b = (sorted(r["samples"][task], key=lambda s: s["doc_id"]) for r in runs)
        assert [s["acc_norm"] for s in a] == [s["acc_norm"] for s in b]
        for x, y in zip(a, b, strict=True):
            assert [r[0][0] for r in x["resps"]] == pytest.approx(
                [r[0][0] for r in y["resps"]], abs=1e-4
            )


@pytest.mark.slow
def test_recipe_backend_engine_scores_a_model_and_an_adapter_as_hflm_does(tmp_path: Path) -> None:
    """`evals.backend: engine` in a recipe: per item, the same accuracies as the default
    backend, for the base and for a LoRA adapter served on it."""
    from evals.variant_evals import measure_quality
    from workbench.pipeline import Pipeline
    from workbench.recipe import load_recipe

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(
        "name: r\nbase: demo-tiny\nvariants:\n  - {name: base}\n"
        "  - {name: lora, steps: [{lora: {rank: 4, steps: 4, batch_size: 4, seq_len: 64, lr: 0.01}}]}\n"
        "evals: {quality: [{task: arc_easy, limit: 6}], max_length: 256, backend: engine}\n"
    )
    recipe, base = load_recipe(recipe_file)
    assert recipe.evals.backend == "engine"
    for variant in Pipeline(recipe, base, tmp_path / "work").run():
        engine = measure_quality(recipe.evals, variant)
        hf = measure_quality(recipe.evals.model_copy(update={"backend": "hf"}), variant)
        assert engine.items["arc_easy"].acc == hf.items["arc_easy"].acc, variant.name
        assert engine.tasks["arc_easy"].acc_norm == hf.tasks["arc_easy"].acc_norm


def test_an_unknown_model_arg_is_refused_by_name(tiny_model_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown model_args \['dtpye'\]; allowed: pretrained"):
        EngineLM(tiny_model_dir, dtpye="float32")


def test_sharing_waves_put_each_context_first_in_chunks_that_fit_the_kv_cache() -> None:
    # 6 contexts of 20 tokens, 4 continuations of 5 tokens each: a context with its requests
    # holds 20 + 4 x (5 + 8) = 72 tokens; 0.8 x 200 = 160 fits two
    windows = [([c] * 20 + [100 + k] * 5, 20) for c in range(6) for k in range(4)]
    waves = sharing_waves(windows, kv_tokens=200, block_size=8)
    assert waves == [
        [0, 4],
        [1, 2, 3, 5, 6, 7],
        [8, 12],
        [9, 10, 11, 13, 14, 15],
        [16, 20],
        [17, 18, 19, 21, 22, 23],
    ]
    # a context bigger than the budget is a chunk of its own; nothing is lost or repeated
    windows.append(([9] * 300 + [1], 300))
    waves = sharing_waves(windows, kv_tokens=200, block_size=8)
    assert waves[-1] == [24] and sorted(i for w in waves for i in w) == list(range(25))


def test_contexts_are_computed_once_when_their_first_requests_overfill_the_kv_cache(
    tiny_model_dir: Path, pair: tuple[EngineLM, HFLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first requests of 12 contexts (300 tokens) do not fit a 208-token KV cache together:
    in one wave pair the first contexts' blocks were evicted before their other requests ran,
    and every request computed its whole window. In chunks, each context is computed once."""
    bytes_per_token = pair[0].llm.engine.runner.layout.bytes_per_token()
    ours = EngineLM(tiny_model_dir, max_length=MAX_LENGTH, kv_cache=str(208 * bytes_per_token))
    assert ours.llm.engine.kv_tokens == 208
    vocab = len(ours.tokenizer)
    requests: list[tuple[None, list[int], list[int]]] = [
        (None, [(7 * c + j) % (vocab - 5) + 5 for j in range(20)], [(c + 3 * k) % vocab] * 5)
        for c in range(12)
        for k in range(4)
    ]
    computed: list[int] = []
    generate = ours.llm.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        outs = generate(*args, **kwargs)
        computed.extend(o.usage.prompt_tokens - o.num_cached_tokens for o in outs)
        return outs

    monkeypatch.setattr(ours.llm, "generate", spy)
    got = ours._loglikelihood_tokens(requests, disable_tqdm=True)
    want = pair[1]._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [s for s, _ in got] == pytest.approx([s for s, _ in want], abs=1e-4)
    assert [g for _, g in got] == [g for _, g in want]
    # each context once with its first continuation (25 tokens), then 3 continuations that read
    # the context's first 16 tokens from the cache (4 blocks of 4; its last token is computed
    # again: its logits score the continuation's first token): 12 x (25 + 3 x (4 + 5)) = 624,
    # against 12 x 4 x 25 = 1,200 for whole windows
    assert sum(computed) == 12 * (25 + 3 * (4 + 5))

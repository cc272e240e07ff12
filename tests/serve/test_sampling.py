"""Sampling through the whole engine: seeds, top-k / top-p, stops, logprobs, the LLM API."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from serve import LLM, SamplingParams
from serve.core.config import CacheConfig
from serve.core.request import FinishReason, Request
from serve.model.sampler import MIN_LOGPROB, logprobs_of, select_rows, token_logprobs
from tests.serve.conftest import Case


@pytest.fixture(scope="module")
def llm(model_dirs: dict[str, Path]) -> LLM:
    return LLM(
        model_dirs["llama"], device="cpu", dtype="float32", cache=CacheConfig(num_blocks=256)
    )


def test_seeded_samples_do_not_depend_on_the_batch(llm: LLM, cases: list[Case]) -> None:
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=42)
    alone = llm.generate([cases[5].prompt], params)[0].token_ids
    others = [SamplingParams(max_tokens=30, temperature=0.8, seed=i) for i in range(6)]
    crowd = llm.generate([c.prompt for c in cases[:6]] + [cases[5].prompt], [*others, params])
    assert crowd[-1].token_ids == alone
    again = llm.generate([cases[5].prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=43))
    assert again[0].token_ids != alone


def test_top_k_1_and_tiny_top_p_are_greedy(llm: LLM, cases: list[Case]) -> None:
    prompts = [c.prompt for c in cases[:6]]
    greedy = [
        o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    ]
    for params in (
        SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=1),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=1),
    ):
        assert [o.token_ids for o in llm.generate(prompts, params)] == greedy


def test_top_k_keeps_samples_inside_the_top_k(llm: LLM, cases: list[Case]) -> None:
    params = SamplingParams(max_tokens=32, temperature=2.0, top_k=3, logprobs=3, seed=5)
    out = llm.generate([cases[3].prompt], params)[0]
    for token, logprobs in zip(out.token_ids, out.logprobs):
        top3 = sorted(logprobs.items(), key=lambda kv: -kv[1])[:3]
        assert token in dict(top3)


def test_logprobs_match_transformers(
    llm: LLM, model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    prompt = cases[4].prompt
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=2))[0]
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    gen = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    for step, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
        expected = gen.logits[step][0].float().log_softmax(-1)
        top = expected.topk(2)
        assert set(logprobs) == {token, *top.indices.tolist()}
        for t, lp in logprobs.items():
            assert lp == pytest.approx(expected[t].item(), abs=1e-4)


def test_stop_strings_and_stop_token_ids(llm: LLM, cases: list[Case]) -> None:
    prompt = cases[7].prompt
    free = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stop = free.text[10:14]
    cut = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop)]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    by_id = llm.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(stop_id,))
    )[0]
    assert by_id.token_ids == free.token_ids[: first + 1] and by_id.finish_reason == "stop"


def test_max_tokens_zero_and_usage(llm: LLM, cases: list[Case]) -> None:
    outs = llm.generate(
        [cases[2].prompt, cases[3].prompt],
        [
            SamplingParams(max_tokens=0),
            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
        ],
    )
    assert outs[0].token_ids == [] and outs[0].finish_reason == "length"
    assert (
        outs[1].usage.prompt_tokens == len(cases[3].prompt) and outs[1].usage.completion_tokens == 3
    )
    assert llm.engine.scheduler.pool.num_free_blocks == llm.engine.runner.num_blocks


def test_text_prompts_are_tokenized_with_bos(llm: LLM) -> None:
    out = llm.generate("Return the", SamplingParams(max_tokens=2, temperature=0))[0]
    assert out.usage.prompt_tokens == len(llm.engine.tokenizer("Return the").input_ids)


def test_ignore_eos_keeps_generating() -> None:
    from serve.core.config import SchedulerConfig
    from serve.core.scheduler import Scheduler

    s = Scheduler(SchedulerConfig(), num_blocks=8, block_size=4)
    s.add_request(
        Request(
            "a", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_ids=frozenset({1})
        )
    )
    for _ in range(3):
        out = s.schedule()
        finished = s.update(out, {"a": 1})
    assert [r.finish_reason for r in finished] == [FinishReason.LENGTH]


def test_invalid_sampling_params_name_the_field() -> None:
    for kwargs, word in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": -2}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": ("",)}, "stop"),
    ]:
        with pytest.raises(ValueError, match=word):
            SamplingParams(**kwargs)


@pytest.mark.parametrize("budget", [2048, 16])
def test_prompt_logprobs_match_transformers(
    model_dirs: dict[str, Path], cases: list[Case], budget: int
) -> None:
    """Every prompt token's logprob (chunked or not), also when the prefix is already cached."""
    from tests.serve.test_engine_exact import make_engine

    prompt = cases[6].prompt[:70]
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    engine = make_engine(model_dirs["llama"], budget=budget)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))  # fills the prefix cache
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("a", prompt, SamplingParams(max_tokens=0, prompt_logprobs=2))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = [o for o in outputs if o.finished]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos, logprobs in enumerate(out.prompt_logprobs[1:], start=1):
        assert prompt[pos] in logprobs and len(logprobs) in (2, 3)
        for token, lp in logprobs.items():
            assert lp == pytest.approx(expected[pos - 1, token].item(), abs=1e-4)
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks


@pytest.mark.parametrize("budget", [2048, 16])
def test_prompt_logprobs_from_a_position_share_the_cached_prefix_before_it(
    model_dirs: dict[str, Path], cases: list[Case], budget: int
) -> None:
    """A scorer of a continuation: logprobs from position 40 on equal transformers', the
    prefix cache serves the whole blocks before position 39, earlier positions get None."""
    from tests.serve.test_engine_exact import make_engine

    prompt = cases[6].prompt[:70]
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    engine = make_engine(model_dirs["llama"], budget=budget)
    engine.add_request("warm", prompt[:60], SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(max_tokens=0, prompt_logprobs=1, prompt_logprobs_from=40)
    engine.add_request("a", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (out,) = [o for o in outputs if o.finished]
    block = engine.scheduler.kv.block_size
    assert out.num_cached_tokens == (39 // block) * block > 0
    assert out.prompt_logprobs[:40] == [None] * 40 and len(out.prompt_logprobs) == len(prompt)
    for pos, logprobs in enumerate(out.prompt_logprobs[40:], start=40):
        assert logprobs is not None and prompt[pos] in logprobs
        for token, lp in logprobs.items():
            assert lp == pytest.approx(expected[pos - 1, token].item(), abs=1e-4)
    assert engine.scheduler.pool.num_free_blocks == engine.runner.num_blocks


def test_consecutive_sample_rows_are_a_view_of_the_logits_not_a_copy() -> None:
    """A decode step samples every row of its logits in order: no copy (64 MB a step at 64
    rows of a 262k vocabulary); scattered rows are gathered."""
    logits = torch.randn(6, 50)
    for rows in ([0, 1, 2, 3, 4, 5], [2, 3, 4], [5]):
        picked = select_rows(logits, rows)
        assert picked.data_ptr() == logits[rows[0]].data_ptr()
        assert torch.equal(picked, logits[rows])
    picked = select_rows(logits, [0, 2, 5])
    assert torch.equal(picked, logits[[0, 2, 5]])


@pytest.mark.parametrize("top_n", [0, 1, 3])
def test_logprobs_of_rows_equal_each_rows_log_softmax(top_n: int) -> None:
    """The batched logprobs (logit - logsumexp) against a row's log-softmax, with its top-n;
    a row with a NaN or -inf logits reports MIN_LOGPROB where its logprob is not finite."""
    torch.manual_seed(top_n)
    rows = torch.randn(5, 3000) * 4
    rows[3, 17] = float("-inf")
    rows[4, 5] = float("nan")
    tokens = [0, 2999, 1234, 17, 6]
    got = logprobs_of(rows, tokens, top_n)
    for row, token, logprobs in zip(rows[:4], tokens, got):
        want = row.log_softmax(-1)
        top = want.topk(top_n).indices.tolist() if top_n else []
        assert list(logprobs) == list(dict.fromkeys([token, *top]))
        for t, lp in logprobs.items():
            expected = float(want[t]) if torch.isfinite(want[t]) else MIN_LOGPROB
            assert lp == pytest.approx(expected, abs=1e-5)
    assert set(got[4].values()) == {MIN_LOGPROB}
    assert got[0] == token_logprobs(rows[0], tokens[0], top_n)

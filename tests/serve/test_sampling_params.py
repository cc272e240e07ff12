"""The logits-changing sampling settings, checked against transformers' own processors (greedy
`generate` with the same setting, token for token) or against their formula on a crafted row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import MinPLogitsWarper

from serve import LLM, SamplingParams
from serve.core.config import CacheConfig
from serve.model.logits_processors import process, truncate
from tests.serve.conftest import Case


@pytest.fixture(scope="module")
def llm(model_dirs: dict[str, Path]) -> LLM:
    return LLM(
        model_dirs["llama"], device="cpu", dtype="float32", cache=CacheConfig(num_blocks=256)
    )


@pytest.fixture(scope="module")
def hf(model_dirs: dict[str, Path]) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()


def _generate(hf: AutoModelForCausalLM, prompt: list[int], new: int, **options: object) -> list:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0, **options
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_generate(
    llm: LLM, hf: AutoModelForCausalLM, cases: list[Case], penalty: float
) -> None:
    for case in cases[2:6]:
        params = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=penalty)
        ours = llm.generate([case.prompt], params)[0].token_ids
        expected = _generate(hf, case.prompt, 24, repetition_penalty=penalty)
        assert ours == expected[: len(ours)] and len(ours) in (len(expected), 24)


def test_logit_bias_equals_generate_with_sequence_bias(
    llm: LLM, hf: AutoModelForCausalLM, cases: list[Case]
) -> None:
    prompt = cases[3].prompt
    plain = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    bias = ((plain[1], -100.0), (17, 4.0))
    params = SamplingParams(max_tokens=8, temperature=0, logit_bias=bias)
    ours = llm.generate([prompt], params)[0].token_ids
    expected = _generate(hf, prompt, 8, sequence_bias={(t,): b for t, b in bias})
    assert ours == expected
    assert plain[1] not in ours


def test_a_large_logit_bias_forces_its_token(llm: LLM, cases: list[Case]) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias=((42, 100.0),))
    assert llm.generate([cases[1].prompt], params)[0].token_ids == [42] * 6


def test_min_tokens_masks_eos_and_stop_ids_like_min_new_tokens(
    llm: LLM, hf: AutoModelForCausalLM, cases: list[Case]
) -> None:
    eos = llm.engine.tokenizer.eos_token_id
    prompt = cases[3].prompt
    plain = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    stop = plain[2]  # a stop id the request would otherwise meet at its third token
    params = SamplingParams(max_tokens=12, temperature=0, min_tokens=6, stop_token_ids=(stop,))
    out = llm.generate([prompt], params)[0]
    assert len(out.token_ids) >= 6 and stop not in out.token_ids[:5]
    expected = _generate(hf, prompt, 12, min_new_tokens=6, eos_token_id=[eos, stop])
    assert out.token_ids == expected[: len(out.token_ids)]
    assert (out.finish_reason == "stop") == (out.token_ids[-1] in (eos, stop))


def test_min_tokens_delays_a_stop_string(llm: LLM, cases: list[Case]) -> None:
    prompt = cases[4].prompt
    plain = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0]
    stop = plain.text[:3].strip() or plain.text[:3]
    stopped = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop=(stop,)))
    held = llm.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0, stop=(stop,), min_tokens=10)
    )
    assert len(stopped[0].token_ids) < 10
    assert held[0].token_ids == plain.token_ids and held[0].finish_reason == "length"


def test_include_stop_str_in_output(llm: LLM, cases: list[Case]) -> None:
    prompt = cases[4].prompt
    plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].text
    stop = plain[4:6]
    cut = plain.index(stop)
    kept = SamplingParams(
        max_tokens=12, temperature=0, stop=(stop,), include_stop_str_in_output=True
    )
    assert llm.generate([prompt], kept)[0].text == plain[: cut + len(stop)]
    dropped = SamplingParams(max_tokens=12, temperature=0, stop=(stop,))
    assert llm.generate([prompt], dropped)[0].text == plain[:cut]


def test_skip_special_tokens_false_keeps_them(llm: LLM, cases: list[Case]) -> None:
    tok = llm.engine.tokenizer
    special = tok.eos_token_id
    forced = ((special, 100.0),)
    kept = SamplingParams(
        max_tokens=2, temperature=0, logit_bias=forced, ignore_eos=True, skip_special_tokens=False
    )
    out = llm.generate([cases[1].prompt], kept)[0]
    assert out.text == tok.eos_token * 2
    skipped = SamplingParams(max_tokens=2, temperature=0, logit_bias=forced, ignore_eos=True)
    assert llm.generate([cases[1].prompt], skipped)[0].text == ""


def test_presence_and_frequency_penalties_follow_the_openai_formula() -> None:
    row = torch.tensor([1.0, 2.0, 3.0, -1.0, 0.5])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process(row, params, prompt_ids=[0, 1], output_ids=[2, 2, 3], stop_ids=(), allowed=None)
    # prompt tokens are not penalized; token 2 twice: 3 - 2 * 0.25 - 0.5; token 3 once
    assert out.tolist() == [1.0, 2.0, 2.0, -1.75, 0.5]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    row = torch.tensor([2.0, -2.0, 4.0, 1.0])
    out = process(row, SamplingParams(repetition_penalty=2.0), [0], [1], (), None)
    assert out.tolist() == [1.0, -4.0, 4.0, 1.0]


def test_min_p_equals_transformers_min_p_warper() -> None:
    torch.manual_seed(0)
    row = torch.randn(50) * 3
    for min_p in (0.05, 0.3):
        params = SamplingParams(temperature=0.7, min_p=min_p)
        ours = truncate(row, params)
        theirs = MinPLogitsWarper(min_p)(None, (row / 0.7)[None])[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_grammar_mask_keeps_only_allowed_tokens() -> None:
    row = torch.tensor([5.0, 1.0, 3.0])
    allowed = torch.tensor([False, True, True])
    out = process(row, SamplingParams(), [], [], (), allowed)
    assert out.tolist() == [float("-inf"), 1.0, 3.0] and int(out.argmax()) == 2


def test_sampling_params_refuse_out_of_range_values() -> None:
    for bad in (
        {"min_p": 1.5},
        {"presence_penalty": 3.0},
        {"repetition_penalty": 0.0},
        {"logit_bias": ((1, 200.0),)},
        {"min_tokens": 20, "max_tokens": 10},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]

"""The output processor builds each client's view from core outputs alone: a stop string ends
the request there and comes back as an abort for the core; nothing writes a core request."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from serve.core.request import FinishReason
from serve.core.sampling_params import OutputKind, SamplingParams
from serve.engine.core_output import CoreOutput
from serve.engine.output_processor import OutputProcessor


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def step(request_id: str, token: int, reason: FinishReason | None = None) -> CoreOutput:
    return CoreOutput(request_id, [token], [], None, reason, 0)


def ids_of(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_a_stop_string_is_returned_as_an_abort_and_ends_the_output(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    tokens = ids_of(tokenizer, "hello world. STOP and more")
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=50, stop=["STOP"], output_kind=OutputKind.DELTA)
    processor.add("r", [1, 2], params)
    texts, stopped_at = [], None
    for k, token in enumerate(tokens):
        outputs, stopped = processor.process([step("r", token)])
        texts += [o.text for o in outputs]
        if stopped:
            assert stopped == ["r"] and outputs[-1].finished
            assert outputs[-1].finish_reason == "stop"
            stopped_at = k
            break
    assert stopped_at is not None and "".join(texts) == "hello world. "
    assert processor.states == {}  # a later step's token for it is dropped
    assert processor.process([step("r", tokens[-1])]) == ([], [])


def test_a_stop_string_in_the_step_that_hit_the_length_limit_is_no_abort_but_a_stop(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    tokens = ids_of(tokenizer, "ab END")
    processor = OutputProcessor(tokenizer)
    processor.add("r", [1], SamplingParams(max_tokens=len(tokens), stop=["END"]))
    for token in tokens[:-1]:
        assert processor.process([step("r", token)])[1] == []
    outputs, stopped = processor.process([step("r", tokens[-1], FinishReason.LENGTH)])
    assert stopped == [] and outputs[0].finish_reason == "stop" and outputs[0].text == "ab "


def test_prompt_logprobs_and_cached_tokens_come_from_the_core_output(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add("r", [5, 6], SamplingParams(max_tokens=2, output_kind=OutputKind.FINAL_ONLY))
    first = CoreOutput("r", [7], [{7: -0.5}], [None, {6: -1.0}], None, 16)
    assert processor.process([first]) == ([], [])
    assert processor.progress == {"r": 1}
    (out,), _ = processor.process(
        [CoreOutput("r", [8], [{8: -0.25}], None, FinishReason.LENGTH, 16)]
    )
    assert (out.token_ids, out.logprobs) == ([7, 8], [{7: -0.5}, {8: -0.25}])
    assert out.prompt_logprobs == [None, {6: -1.0}] and out.num_cached_tokens == 16

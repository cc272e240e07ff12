"""Incremental detokenization gives the text a whole-output decode gives, never shows half a
character, finds stop strings that span steps, and decodes a bounded window per step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from serve.core.detokenizer import REPLACEMENT, IncrementalDetokenizer, decode_text, text_decoder

MULTI_BYTE = "naïve 日本語 🤖 café — ok. Ünïcödé ∑ x² → ∞ 🎉🎉 end"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def feed(detok: IncrementalDetokenizer, ids: list[int], seed: int) -> list[str]:
    """Give `ids` in random step sizes (1-4 tokens, as decode and speculative-style steps do);
    returns the new text of each step; the last step is final."""
    rng, pieces, n = random.Random(seed), [], 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 4))
        pieces.append(detok.update(ids[:n], final=n == len(ids)))
    return pieces


def test_long_random_output_equals_a_whole_decode(tokenizer: PreTrainedTokenizerBase) -> None:
    rng = random.Random(0)
    ids = [rng.randrange(len(tokenizer)) for _ in range(3000)]  # specials and byte pieces too
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    pieces = feed(detok, ids, seed=1)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.text == "".join(pieces) == whole


def test_multi_byte_characters_never_show_half(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.encode(MULTI_BYTE, add_special_tokens=False)
    assert any(REPLACEMENT in tokenizer.decode(ids[:i]) for i in range(1, len(ids)))
    for seed in range(5):
        detok = IncrementalDetokenizer(tokenizer, stop=[])
        pieces = feed(detok, ids, seed)
        assert all(REPLACEMENT not in p for p in pieces)
        assert detok.text == MULTI_BYTE


def test_an_incomplete_character_at_the_end_is_kept_as_a_whole_decode_keeps_it(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = tokenizer.encode("ab 🤖", add_special_tokens=False)[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n], final=n == len(ids))
    assert detok.text == tokenizer.decode(ids) and detok.text.endswith(REPLACEMENT)


def test_stop_string_spanning_steps_is_found_and_cut(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "first line. STOP here, STOP again"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["never", "STOP"])
    n = 0
    while not detok.stopped and n < len(ids):
        n += 1
        detok.update(ids[:n])
    assert detok.stopped and detok.text == "first line. "
    assert detok.update(ids) == ""  # nothing after a stop
    # one token at a time: found at the very step whose token completes the first "STOP"
    assert "STOP" in tokenizer.decode(ids[:n]) and "STOP" not in tokenizer.decode(ids[: n - 1])


def test_each_step_decodes_a_bounded_window(tokenizer: PreTrainedTokenizerBase) -> None:
    decoded: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            decoded.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(MULTI_BYTE * 40, add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting(), stop=["zzz"])  # type: ignore[arg-type]
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n], final=n == len(ids))
    assert len(ids) > 1000 and detok.text == MULTI_BYTE * 40
    assert max(decoded) <= 8  # a whole-output decode would reach len(ids)


def test_the_backend_decodes_exactly_as_transformers_without_its_wrapper(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain fast tokenizer is decoded by its `tokenizers` backend: the same text as
    `tokenizer.decode` for random ids (special tokens and byte pieces too), with and without
    skipping specials, and `tokenizer.decode` itself is not called."""
    rng = random.Random(3)
    samples = [
        [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 40))] for _ in range(200)
    ]
    for skip in (True, False):
        expected = [tokenizer.decode(ids, skip_special_tokens=skip) for ids in samples]
        with monkeypatch.context() as patch:
            patch.setattr(tokenizer, "decode", lambda *a, **k: pytest.fail("wrapper called"))
            decode = text_decoder(tokenizer, skip)
            assert [decode(ids) for ids in samples] == expected
            assert decode_text(tokenizer, samples[0], skip) == expected[0]


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[int]] = []
    original = tokenizer.decode

    def counted(ids: list[int], skip_special_tokens: bool = False) -> str:
        calls.append(ids)
        return original(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tokenizer, "decode", counted)
    ids = tokenizer.encode("a , b .", add_special_tokens=False)
    assert text_decoder(tokenizer)(ids) == original(ids, skip_special_tokens=True)
    assert calls == [ids]

"""Greedy sampling's argmax kernel (`serve/model/greedy.py`) against `torch.argmax`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.model.greedy import argmax_rows, load_argmax, pack_allowed, unpack_allowed

needs_kernel = pytest.mark.skipif(
    load_argmax() is None, reason="no C compiler (cc or $CC) to build the argmax kernel"
)
VALUES = st.floats(width=32, allow_nan=True, allow_infinity=True)


@needs_kernel
@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(VALUES, min_size=1, max_size=70), min_size=1, max_size=4))
def test_argmax_rows_equals_torch_argmax_with_nans_infinities_and_ties(rows: list) -> None:
    """Rows of any values (NaN wins, first of equal values, -inf rows give 0), padded to one
    width with repeats of their own values so that ties across lanes occur."""
    width = max(len(r) for r in rows)
    padded = [(r * width)[:width] for r in rows]
    logits = torch.tensor(padded, dtype=torch.float32)
    assert argmax_rows(logits) == logits.argmax(-1).tolist()


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49_152, 262_144 + 5])
def test_argmax_rows_on_vocabulary_sized_rows(vocab: int) -> None:
    torch.manual_seed(vocab)
    logits = torch.randn(9, vocab)
    logits[1] = 0.0  # every lane ties: index 0
    logits[2, vocab // 2 :] = 7.0  # ties spread over lanes: the first
    logits[3, -1] = float("nan")
    logits[4] = float("-inf")
    logits[5, :: max(1, vocab // 3)] = float("inf")
    assert argmax_rows(logits) == logits.argmax(-1).tolist()


@needs_kernel
def test_argmax_rows_reads_views_in_place_and_falls_back_for_the_rest() -> None:
    """Consecutive rows of a step's logits (`select_rows`) and a column slice are read in
    place; a transposed tensor, float64 and an empty vocabulary go to torch."""
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    for view in (logits[2:6], logits[:, 100:700], logits.t().contiguous().t()):
        assert argmax_rows(view) == view.argmax(-1).tolist()
    assert argmax_rows(logits.t()) == logits.t().argmax(-1).tolist()
    assert argmax_rows(logits.double()) == logits.argmax(-1).tolist()
    assert argmax_rows(torch.empty(0, 10)) == []
    with pytest.raises(IndexError):
        argmax_rows(torch.empty(3, 0))  # as torch.argmax: no value to pick


def masked_argmax(logits: torch.Tensor, words: torch.Tensor) -> list[int]:
    """torch's answer: every token the bitmask does not allow set to -inf."""
    allowed = unpack_allowed(words, logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf")).argmax(-1).tolist()


def test_pack_and_unpack_round_trip() -> None:
    allowed = torch.rand(3, 100) < 0.5
    allowed[0, 31] = allowed[1, 63] = True  # the sign bit of a word
    assert torch.equal(unpack_allowed(pack_allowed(allowed), 100), allowed)


@needs_kernel
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(VALUES, min_size=1, max_size=100), min_size=1, max_size=4),
    st.lists(st.sampled_from([0.0, 0.05, 0.5, 1.0]), min_size=4, max_size=4),
    st.integers(0, 2**16),
)
def test_argmax_through_a_bitmask_equals_torch_on_the_masked_row(
    rows: list, densities: list, seed: int
) -> None:
    """Bitmasks that allow none, a few, half or all of each word's tokens (full words take the
    vectorized path, others token by token), NaNs, infinities and ties among allowed tokens."""
    width = max(len(r) for r in rows)
    logits = torch.tensor([(r * width)[:width] for r in rows], dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    density = torch.tensor(densities[: len(rows)])[:, None]
    allowed = torch.rand(len(rows), width, generator=g) < density
    words = pack_allowed(allowed)
    assert argmax_rows(logits, words) == masked_argmax(logits, words)


@needs_kernel
@pytest.mark.parametrize("vocab", [33, 512, 49_152 + 7, 262_144])
def test_argmax_through_a_bitmask_on_vocabulary_sized_rows(vocab: int) -> None:
    torch.manual_seed(vocab)
    logits = torch.randn(7, vocab)
    allowed = torch.ones(7, vocab, dtype=torch.bool)
    allowed[1, : vocab // 2] = False  # the largest values may be masked
    allowed[2] = torch.rand(vocab) < 0.01
    allowed[3] = False
    allowed[3, -1] = True  # only the last token, in a partial word
    allowed[4, ::3] = False
    logits[4, 0::3] = 50.0  # the masked tokens would win
    logits[5, 7] = float("nan")
    allowed[5, 7] = False  # a masked NaN does not win
    allowed[6] = False  # nothing allowed: 0, as torch
    words = pack_allowed(allowed)
    assert argmax_rows(logits, words) == masked_argmax(logits, words)
    assert argmax_rows(logits[1:3], words[1:3]) == masked_argmax(logits[1:3], words[1:3])


def test_without_a_compiler_greedy_sampling_takes_torch_argmax(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    load_argmax.cache_clear()
    try:
        assert load_argmax() is None
        logits = torch.randn(4, 300)
        assert argmax_rows(logits) == logits.argmax(-1).tolist()
        words = pack_allowed(torch.rand(4, 300) < 0.3)
        assert argmax_rows(logits, words) == masked_argmax(logits, words)
    finally:
        monkeypatch.undo()
        load_argmax.cache_clear()

"""Incremental detokenization: each step decodes a few tokens, not the whole output.

Model (vLLM's prefix/read offsets): the text is final up to `read_offset` output tokens. A step
decodes the window `[prefix_offset, len)` and the already-read part `[prefix_offset,
read_offset)`; what the first adds to the second is the new text. The window starts a few tokens
back so that tokenizers which merge neighbours (SentencePiece's leading space, byte-level BPE's
multi-byte characters) see context. Text that ends in U+FFFD (an incomplete UTF-8 sequence) is held
back until the bytes that complete it arrive (or the request ends: then the text is what a
whole-output decode gives). Stop strings are searched only where a match can
newly appear: the new text and the `longest stop - 1` characters before it; the text is cut
before the first match (after it, with `include_stop`).
A fast tokenizer whose `decode` is transformers' own, with no clean-up of spaces, is decoded by
its `tokenizers` backend directly (`text_decoder`): the same call transformers makes, without its
per-call Python (about 4 us of 6-10 a call, two calls a token of every running request).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


def decode_text(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool = True
) -> str:
    """The text of `ids`, special tokens skipped unless asked for."""
    return text_decoder(tokenizer, skip_special_tokens)(ids)


def text_decoder(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True
) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=...)`, through the `tokenizers`
    backend where that is exactly what `decode` does (see the module's docstring)."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase as Base
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and kind.decode is Base.decode
        and kind._decode is TokenizersBackend._decode
        and not tokenizer.clean_up_tokenization_spaces
        and backend is not None
    ):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode(ids: list[int]) -> str:
        text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # one sequence in, one string out
        return text

    return decode


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop: Sequence[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.stopped = False
        self._decode = text_decoder(tokenizer, skip_special_tokens)

    def update(self, output_token_ids: list[int], final: bool = False, search: bool = True) -> str:
        """Extend `text` with what `output_token_ids` (all of them so far) add; returns the new
        text. `final`: the request ends here, so an incomplete character is not held back;
        `search`: look for stop strings in the new text. After a stop string is found, `text`
        ends before it (or after it, with `include_stop`) and `stopped` is True."""
        if self.stopped or len(output_token_ids) <= self.read_offset:
            return ""
        read = self._decode(output_token_ids[self.prefix_offset : self.read_offset])
        window = self._decode(output_token_ids[self.prefix_offset :])
        if len(window) <= len(read) or (window.endswith(REPLACEMENT) and not final):
            return ""  # nothing printable yet (a special token, or a character not complete)
        new = window[len(read) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(output_token_ids)
        start = len(self.text)
        self.text += new
        if self.stop and search:
            self._find_stop(max(0, start - self.longest_stop + 1))
        return self.text[start:]

    def _find_stop(self, search_from: int) -> None:
        hits = [(i, len(s)) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            at, length = min(hits)
            self.text = self.text[: at + length if self.include_stop else at]
            self.stopped = True

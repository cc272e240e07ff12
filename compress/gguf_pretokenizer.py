"""llama.cpp's name for a tokenizer's pre-tokenizer (`tokenizer.ggml.pre` in a GGUF file).

Model: before BPE merges, both transformers and llama.cpp split text into words by a regex; in
a GGUF file the regex is named, not stored, and llama.cpp knows a fixed set of names. A name
whose regex differs from the tokenizer's own splits some text differently (llama.cpp's
`default` splits contractions and `$3.50` unlike GPT-2's byte-level regex), so the exported
model would read other tokens than it was trained on. The name is read off the tokenizer's
`pre_tokenizer` (tokenizer.json): its structure and regex must be one llama.cpp implements
exactly; anything else is refused rather than guessed. llama.cpp's own converter recognises
tokenizers by hashing their output on a test text, which needs the model's hub name listed in
it; this reads the definition itself, so any tokenizer built the same way is recognised.
"""

from __future__ import annotations

import json
from typing import Any

SPLIT_REGEXES = {
    # Llama 3: numbers in runs of up to three digits
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    # Qwen 2 / 2.5 / 3: every digit on its own
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}
"""A `Split(Regex)` followed by a regex-free `ByteLevel`: the regex, and llama.cpp's name."""


class UnknownPreTokenizer(ValueError):
    pass


def _is_byte_level(step: dict[str, Any], regex: bool) -> bool:
    """transformers' `ByteLevel`, splitting by GPT-2's regex (llama.cpp's `gpt-2`) or not at
    all; llama.cpp never adds a leading space."""
    return (
        step.get("type") == "ByteLevel"
        and bool(step.get("use_regex", True)) == regex
        and not step.get("add_prefix_space")
    )


def pre_tokenizer_name(backend: dict[str, Any]) -> str:
    """llama.cpp's name for the pre-tokenizer of `backend` (a parsed tokenizer.json)."""
    pre = backend.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and _is_byte_level(steps[0], regex=True):
        return "gpt-2"
    if len(steps) == 2 and _is_byte_level(steps[1], regex=True):
        digits = steps[0]
        if digits.get("type") == "Digits" and digits.get("individual_digits"):
            return "smollm"  # each digit alone, then GPT-2's regex
    if len(steps) == 2 and _is_byte_level(steps[1], regex=False):
        split = steps[0]
        regex = (split.get("pattern") or {}).get("Regex")
        usual = split.get("behavior") == "Isolated" and not split.get("invert")
        if split.get("type") == "Split" and usual and regex in SPLIT_REGEXES:
            return SPLIT_REGEXES[regex]
    raise UnknownPreTokenizer(
        f"the tokenizer's pre-tokenizer {json.dumps(pre)[:300]} is none of those llama.cpp "
        "implements by name here (GPT-2 byte-level, SmolLM's digits + byte-level, Llama 3's and "
        "Qwen 2's regex); llama.cpp would split text differently from the model's tokenizer. "
        "Export as hf and convert with llama.cpp's convert_hf_to_gguf.py"
    )

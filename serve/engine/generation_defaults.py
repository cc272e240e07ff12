"""What a model's generation_config.json adds to serving: end-of-sequence ids and the
sampling defaults of fields a request leaves out (vLLM's `--generation-config auto`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json fields a request's unset fields default to (vLLM's list), and the
request field each becomes."""


def generation_config(model: PreTrainedModel, source: str) -> GenerationConfig | None:
    """The generation config `source` names (see `ModelConfig.generation_config`)."""
    if source == "vllm":
        return None
    if source == "auto":
        return model.generation_config
    try:
        return GenerationConfig.from_pretrained(source)
    except OSError as e:
        raise ValueError(
            f"generation_config {source!r}: no generation_config.json there ({e}); give a "
            "folder holding one, auto or vllm"
        ) from e


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, list | tuple) else [value])}


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: frozenset[int]
    """The tokenizer's end-of-sequence id and those the generation config lists."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Request field -> default, for the fields the generation config sets (to values other
    than transformers' own defaults)."""

    @staticmethod
    def read(
        model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, source: str
    ) -> GenerationDefaults:
        """`source`: `auto` (the model's), `vllm` (none) or a folder with the file."""
        gen = generation_config(model, source)
        eos = _ids(tokenizer.eos_token_id) | _ids(gen.eos_token_id if gen else None)
        diff = gen.to_diff_dict() if gen is not None else {}
        sampling = {
            name: diff[key]
            for key, name in GENERATION_DEFAULTS.items()
            if diff.get(key) is not None
        }
        return GenerationDefaults(frozenset(eos), sampling)

"""What a request must satisfy before the engine takes it; each refusal names the limit."""

from __future__ import annotations

from dataclasses import dataclass

from serve.core.kv_cache_manager import cdiv
from serve.core.sampling_params import SamplingParams
from serve.engine.errors import InvalidRequest


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int

    @property
    def kv_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.num_blocks * self.block_size

    def check(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise `InvalidRequest` for a prompt or parameters the engine cannot serve."""
        vocab = self.vocab_size
        if not token_ids:
            raise InvalidRequest("the prompt is empty; give at least one token")
        if bad := [t for t in token_ids if not 0 <= t < vocab]:
            raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        named = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
        if bad := [t for t in named if not 0 <= t < vocab]:
            raise InvalidRequest(
                f"logit_bias / stop_token_ids name token ids {bad[:5]} outside the vocabulary "
                f"[0, {vocab})"
            )
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len ({self.max_model_len}); shorten the prompt or lower "
                "max_tokens"
            )
        if cdiv(total, self.block_size) > self.num_blocks:
            raise InvalidRequest(
                f"prompt + max_tokens = {total} tokens exceeds the KV cache ({self.kv_tokens} "
                "tokens); give the engine more KV memory or lower max_tokens"
            )

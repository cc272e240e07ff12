"""OpenAI response bodies (completion and chat, whole and streamed) from engine outputs."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from serve.detokenizer import decode_text
from serve.engine import RequestOutput


def token_strings(tok: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    return tok.batch_decode([[i] for i in ids])


def completion_logprobs(
    tok: PreTrainedTokenizerBase, out: RequestOutput, echo: bool, offset: int
) -> dict[str, Any]:
    """The legacy completions `logprobs` object; with echo, prompt tokens come first (the first
    prompt token has no logprob: None), as lm-eval's loglikelihood requests expect."""
    ids = (out.prompt_token_ids if echo else []) + out.token_ids
    per_token = (out.prompt_logprobs if echo else []) + list(out.logprobs)
    strings = token_strings(tok, ids)
    offsets, pos = [], offset
    for s in strings:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": strings,
        "token_logprobs": [None if lp is None else lp[i] for i, lp in zip(ids, per_token)],
        "top_logprobs": [None if lp is None else _top_all(tok, lp) for lp in per_token],
        "text_offset": offsets,
    }


def _top_all(tok: PreTrainedTokenizerBase, logprobs: dict[int, float]) -> dict[str, float]:
    ranked = sorted(logprobs.items(), key=lambda kv: -kv[1])
    return dict(zip(token_strings(tok, [i for i, _ in ranked]), [lp for _, lp in ranked]))


def completion_choice(
    tok: PreTrainedTokenizerBase, index: int, out: RequestOutput, echo: bool, want_logprobs: bool
) -> dict[str, Any]:
    prompt_text = decode_text(tok, out.prompt_token_ids) if echo else ""
    logprobs = completion_logprobs(tok, out, echo, 0) if want_logprobs else None
    return {
        "index": index,
        "text": prompt_text + out.text,
        "logprobs": logprobs,
        "finish_reason": out.finish_reason,
    }


def chat_logprobs(tok: PreTrainedTokenizerBase, out: RequestOutput, top_n: int) -> dict[str, Any]:
    content = []
    for token_id, lps in zip(out.token_ids, out.logprobs):
        (text,) = token_strings(tok, [token_id])
        ranked = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
        tops = [
            {"token": s, "logprob": lp, "bytes": list(s.encode())}
            for s, (_, lp) in zip(token_strings(tok, [i for i, _ in ranked]), ranked)
        ]
        content.append(
            {
                "token": text,
                "logprob": lps[token_id],
                "bytes": list(text.encode()),
                "top_logprobs": tops,
            }
        )
    return {"content": content}


def chat_choice(
    tok: PreTrainedTokenizerBase, index: int, out: RequestOutput, top_n: int | None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": out.text},
        "logprobs": chat_logprobs(tok, out, top_n) if top_n is not None else None,
        "finish_reason": out.finish_reason,
    }


__all__ = ["chat_choice", "completion_choice", "token_strings"]

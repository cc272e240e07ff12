"""What acts on one request's logits row before the sampler picks from it.

Order (vLLM's): the grammar's allowed tokens, min_tokens (end-of-sequence and stop ids masked),
logit bias, then the penalties (repetition over prompt and output; presence and frequency over
the output). Then a greedy request takes the argmax; any other is divided by its temperature and
cut by min-p, top-k and top-p before it is drawn from. Logprobs are read from the raw logits.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from serve.core.sampling_params import SamplingParams

NEG_INF = float("-inf")


def process(
    row: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    stop_ids: Collection[int],
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """A float32 copy of `row` with every logits-changing setting of `params` applied.
    `stop_ids`: end-of-sequence and stop token ids; `allowed`: a bool mask from a grammar."""
    row = row.float().clone()
    vocab = row.numel()
    if allowed is not None:
        row.masked_fill_(~allowed[:vocab], NEG_INF)
    if len(output_ids) < params.min_tokens and stop_ids:
        row[[t for t in stop_ids if t < vocab]] = NEG_INF
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        row.index_add_(0, torch.tensor(ids), torch.tensor(bias, dtype=row.dtype))
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.long)] = True
        penalized = torch.where(
            row > 0, row / params.repetition_penalty, row * params.repetition_penalty
        )
        row = torch.where(seen, penalized, row)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return row


def truncate(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p: the distribution a non-greedy request draws
    from, as logits (-inf where cut)."""
    logits = logits / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), NEG_INF)
    if params.top_k is not None and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p
        drop[0] = False  # NOTE: a top_p below float32's resolution would otherwise drop all
        logits = logits.masked_fill(drop.scatter(0, order, drop), NEG_INF)
    return logits

"""Turn each sampling request's logits row into its next token (and its logprobs).

Model: a row is first processed by what changes logits (`logits_processors.process`: grammar,
min_tokens, logit bias, penalties); greedy rows then take the argmax (the fast path when every
row is greedy and nothing changes its logits). Other rows are divided by their temperature, cut
by min-p, top-k and top-p, and drawn from with the request's own generator when it has a seed (so
its samples do not depend on the batch around it) or with the engine's generator otherwise.
Logprobs come from the unmodified logits, as in vLLM.

NOTE: no logits row can make the sampler fail: top-p always keeps the most likely token, a row
whose probabilities are not finite (a NaN from the model, an overflow) falls back to its argmax,
and logprobs that are not finite are reported as `MIN_LOGPROB` (JSON has no -inf).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from serve.core.sampling_params import SamplingParams
from serve.model.greedy import argmax_rows, unpack_allowed
from serve.model.logits_processors import process, truncate

MIN_LOGPROB = -9999.0
"""Reported instead of -inf or NaN (as vLLM does)."""


@dataclass(frozen=True)
class SampleInput:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    stop_token_ids: Collection[int] = ()
    """End-of-sequence and stop ids: masked while fewer than min_tokens are out."""
    constrained: bool = False
    """A grammar limits the next token (its row of `sample`'s `allowed` bitmask)."""

    @property
    def plain(self) -> bool:
        """Greedy, and nothing changes the logits: the argmax of the raw row."""
        return self.params.greedy and not self.params.changes_logits

    @property
    def masked_greedy(self) -> bool:
        """Greedy, and only a grammar's mask changes the logits: batched with its likes."""
        return self.constrained and self.params.masked_argmax


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprobs: dict[int, float] | None
    """The sampled token's logprob and the top-N, when the request asked for logprobs."""


def select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`logits[rows]`: a view when the rows are consecutive (a decode step samples every row of
    its logits in order; a gather would copy them, 64 MB a step for 64 rows of a 262k vocabulary)."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return logits[rows[0] : rows[0] + len(rows)]
    return logits[rows]


def token_logprobs(row: torch.Tensor, token_id: int, top_n: int) -> dict[int, float]:
    """{token: logprob} for `token_id` and the `top_n` most likely tokens of one logits row."""
    return logprobs_of(row[None], [token_id], top_n)[0]


def logprobs_of(rows: torch.Tensor, token_ids: Sequence[int], top_n: int) -> list[dict[int, float]]:
    """`token_logprobs` of each row of [len(token_ids), vocab] logits and its token, in one
    pass: logprob = logit - logsumexp(row), so no row's whole log-softmax is written (at Gemma 3's
    262k vocabulary, a per-row log-softmax and top-k took 1 ms a scored token)."""
    rows = rows.float()
    norms = torch.logsumexp(rows, -1)
    n = torch.arange(len(token_ids))
    picked = (rows[n, torch.tensor(token_ids, dtype=torch.long)] - norms).tolist()
    out = [{t: _finite(v)} for t, v in zip(token_ids, picked)]
    if top_n == 1:
        best = argmax_rows(rows)
        values = (rows[n, torch.tensor(best, dtype=torch.long)] - norms).tolist()
        for logprobs, t, v in zip(out, best, values):
            logprobs[t] = _finite(v)
    elif top_n:
        top = rows.topk(top_n)
        values = (top.values - norms[:, None]).tolist()
        for logprobs, ids, vs in zip(out, top.indices.tolist(), values):
            logprobs.update(zip(ids, map(_finite, vs)))
    return out


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}
        """Seeded requests' own generators, kept across preemption until `release`."""

    def generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        """The request's own generator (None without a seed: it draws from the engine's)."""
        if seed is None:
            return None
        if request_id not in self.request_generators:
            # NOTE: manual_seed takes [-2**63, 2**64); negative seeds map onto the same space.
            self.request_generators[request_id] = torch.Generator().manual_seed(seed % 2**64)
        return self.request_generators[request_id]

    def release(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, inputs: list[SampleInput], allowed: torch.Tensor | None = None
    ) -> list[Sampled]:
        """logits: float32 [len(inputs), vocab], on any device; `allowed`: the grammars' packed
        bitmasks (int32 [len(inputs), ceil(vocab / 32)], every bit set in unconstrained rows)."""
        # the plain and grammar-masked greedy rows' tokens in one pass; the others redrawn
        token_ids = argmax_rows(logits, allowed)
        others = [k for k, i in enumerate(inputs) if not (i.plain or i.masked_greedy)]
        if others:
            # NOTE: on the CPU each row is a view (a gather of every row would copy megabytes
            # of logits per step); elsewhere the rows come to the host in one transfer.
            rows = (logits[k] for k in others) if logits.is_cpu else logits[others].cpu()
            for k, row in zip(others, rows):
                mask = None
                if inputs[k].constrained and allowed is not None:
                    mask = unpack_allowed(allowed[k].cpu(), row.shape[-1])
                token_ids[k] = self._one(row, inputs[k], mask)
        return [
            Sampled(
                t,
                token_logprobs(row, t, i.params.logprobs)
                if i.params.logprobs is not None
                else None,
            )
            for row, t, i in zip(logits, token_ids, inputs)
        ]

    def _one(self, row: torch.Tensor, item: SampleInput, allowed: torch.Tensor | None) -> int:
        """A row that is not plain (`sample` took those in one argmax); `allowed`: its grammar's
        mask (bool [vocab])."""
        if item.params.changes_logits:
            row = process(
                row,
                item.params,
                item.prompt_token_ids,
                item.output_token_ids,
                item.stop_token_ids,
                allowed,
            )
        if item.params.greedy:
            return int(row.nan_to_num(nan=float("-inf")).argmax())
        probs = truncate(row, item.params).softmax(-1)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            return int(row.nan_to_num(nan=float("-inf")).argmax())
        return int(torch.multinomial(probs, 1, generator=item.generator or self.generator))

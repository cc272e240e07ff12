"""lm-eval's `HFLM` with loglikelihood scoring that projects onto the vocabulary only where lm-eval
reads the result.

Model: HFLM runs the output head and a log-softmax over the whole vocabulary at every position of a
batch, then keeps the continuation's positions. On Gemma 3 (262,144 tokens, a 640-wide hidden state)
the head is ~170M multiply-adds per position against ~100M for the whole decoder stack, so most of an
evaluation's time goes to positions nobody reads. Here the decoder runs once per batch of windows
(right-padded, without a mask: causal attention keeps every real position's result exactly as
unpadded), the hidden states that predict a continuation token are gathered by a pre-hook on the
output embedding, and only those reach the head; the model's own code after the head (Gemma's logit
softcapping, say) runs unchanged. Windows are lm-eval's: `(context + continuation)` cut on the left
to `max_length + 1` tokens, the continuation's last tokens scored. Requests with the same window
share a row (a multiple-choice question's one-token answers are one forward). Answers are lm-eval's:
`(sum of the continuation's log-probabilities, whether each continuation token is the argmax)`, the
log-softmax taken in float32 whatever the model's dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

POSITIONS_PER_FORWARD = 2048
"""The most head positions one forward projects (with Gemma's vocabulary, 2 GiB of float32
logits): batches of long windows, rolling perplexity's, are split to stay under it."""


def scored_window(
    context: list[int], continuation: list[int], max_length: int
) -> tuple[list[int], int]:
    """lm-eval's window for a (context, continuation) request: the two joined and cut on the left
    to `max_length + 1` tokens (a model is fed all but the last), and how many of its last tokens
    are scored: the continuation's, unless the cut reached into it."""
    whole = (context + continuation)[-(max_length + 1) :]
    return whole, min(len(continuation), len(whole) - 1)


@dataclass(frozen=True)
class _Scored:
    """One request: its window's row and the positions whose predictions it reads."""

    row: int
    start: int  # first position predicting a continuation token
    targets: tuple[int, ...]


@contextlib.contextmanager
def _head_positions(model: Any, rows: torch.Tensor, cols: torch.Tensor) -> Iterator[None]:
    """While open, the output embedding sees only the hidden states at (rows, cols), as one
    sequence: the model returns logits of shape [1, len(rows), vocab]."""

    def gather(_: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0][rows, cols].unsqueeze(0), *args[1:])

    handle = model.get_output_embeddings().register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()


class ContinuationLM(HFLM):
    """HFLM whose `loglikelihood` and `loglikelihood_rolling` project only the scored positions;
    generation is HFLM's."""

    def _plan(self, requests: list[Any]) -> tuple[list[tuple[int, ...]], list[_Scored]]:
        windows: dict[tuple[int, ...], int] = {}
        scored = []
        for _, context, continuation in requests:
            whole, n = scored_window(list(context), list(continuation), self.max_length)
            window = tuple(whole[:-1])
            row = windows.setdefault(window, len(windows))
            targets = tuple(continuation[len(continuation) - n :])
            scored.append(_Scored(row, len(window) - n, targets))
        return list(windows), scored

    def _batches(
        self, windows: list[tuple[int, ...]], needed: list[set[int]], size: int
    ) -> Iterator[list[int]]:
        """Row indices, longest windows first, `size` rows or POSITIONS_PER_FORWARD head
        positions at most per batch (a single longer row goes alone)."""
        batch: list[int] = []
        positions = 0
        for row in sorted(range(len(windows)), key=lambda r: -len(windows[r])):
            if batch and (
                len(batch) == size or positions + len(needed[row]) > POSITIONS_PER_FORWARD
            ):
                yield batch
                batch, positions = [], 0
            batch.append(row)
            positions += len(needed[row])
        if batch:
            yield batch

    @torch.no_grad()
    def _project(
        self, windows: list[tuple[int, ...]], batch: list[int], needed: list[set[int]]
    ) -> dict[tuple[int, int], tuple[torch.Tensor, int]]:
        """{(row, position): (log-probabilities over the vocabulary, argmax)} for the batch."""
        width = len(windows[batch[0]])
        inputs = torch.zeros(len(batch), width, dtype=torch.long)
        keys = []
        for i, row in enumerate(batch):
            inputs[i, : len(windows[row])] = torch.tensor(windows[row])
            keys += [(i, row, p) for p in sorted(needed[row])]
        rows = torch.tensor([i for i, _, _ in keys], device=self.device)
        cols = torch.tensor([p for _, _, p in keys], device=self.device)
        with _head_positions(self.model, rows, cols):
            logits = self.model(inputs.to(self.device)).logits[0]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        greedy = log_probs.argmax(dim=-1).tolist()
        return {(row, p): (log_probs[k], greedy[k]) for k, (_, row, p) in enumerate(keys)}

    def _loglikelihood_tokens(
        self, requests: list[Any], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        windows, scored = self._plan(requests)
        needed: list[set[int]] = [set() for _ in windows]
        by_row: list[list[int]] = [[] for _ in windows]
        for i, s in enumerate(scored):
            needed[s.row].update(range(s.start, s.start + len(s.targets)))
            by_row[s.row].append(i)
        answers: list[tuple[float, bool] | None] = [None] * len(requests)
        size = int(override_bs or self.batch_size)
        bar = tqdm(
            total=len(requests), disable=disable_tqdm or self.rank != 0, desc="loglikelihood"
        )
        for batch in self._batches(windows, needed, size):
            projected = self._project(windows, batch, needed)
            for row in batch:
                for i in by_row[row]:
                    answers[i] = self._answer(scored[i], projected)
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answers[i])
                bar.update(len(by_row[row]))
        bar.close()
        return [a for a in answers if a is not None]

    @staticmethod
    def _answer(
        s: _Scored, projected: dict[tuple[int, int], tuple[torch.Tensor, int]]
    ) -> tuple[float, bool]:
        total = 0.0
        greedy = True
        for offset, target in enumerate(s.targets):
            log_probs, best = projected[(s.row, s.start + offset)]
            total += float(log_probs[target])
            greedy = greedy and best == target
        return total, greedy

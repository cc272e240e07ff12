"""Decode steps replayed from captured graphs, one graph per batch-size bucket.

Model: a decode-only step of n sequences is padded to the smallest bucket b >= n (1, 2, 4, 8,
then steps of 16 up to `max_num_seqs`, which is always the last). Its inputs already sit in the
runner's persistent buffers (`input_buffers.py`); rows n .. b - 1 are made padding that reads
and writes only the null block, and bucket b's graph replays the model body (embeddings, decoder
layers, final norm: no head) over the buffers' first b rows into a static hidden-state output.
The head (logits) and sampling run outside the graph, on the n real rows only.

Graphs are captured once the KV cache is sized, largest bucket first (the smaller graphs then
fit in the memory the largest one's pool already holds), all in one pool, each after one
warm-up run of its body. Steps a graph cannot run (prefill chunks, more sequences than the
largest bucket, LoRA rows) run eagerly and are counted by reason.

The graph backend is injectable: `CUDAGraphBackend` captures `torch.cuda.CUDAGraph`s;
`ReplayGraphBackend`, the CPU stand-in, keeps the recorded callable and calls it again on each
replay against the same static buffers, so bucketing, padding, static buffers and fallbacks run
in CPU CI, where any per-step state the body failed to read from the buffers shows as wrong
tokens.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import torch


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """Captures callables as graphs sharing one memory pool."""

    def new_pool(self) -> Any:
        """A memory pool handle for `capture`."""
        ...

    def warm_up(self, body: Callable[[], None]) -> None:
        """Run `body` once before its capture (lazy initialisations happen outside the graph)."""
        ...

    def capture(self, body: Callable[[], None], pool: Any) -> Graph:
        """Record `body` (already warmed up) as a graph allocating from `pool`."""
        ...


class CUDAGraphBackend:
    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def warm_up(self, body: Callable[[], None]) -> None:
        """On a side stream, as torch's CUDA graph notes advise before a capture."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)

    def capture(self, body: Callable[[], None], pool: Any) -> Graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            body()
        return graph


class _Replay:
    def __init__(self, body: Callable[[], None]) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


class ReplayGraphBackend:
    """The CPU stand-in: a "graph" calls its recorded body again."""

    def new_pool(self) -> Any:
        return object()

    def warm_up(self, body: Callable[[], None]) -> None:
        body()

    def capture(self, body: Callable[[], None], pool: Any) -> Graph:
        return _Replay(body)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, then `max_num_seqs` itself: every count up to it has a
    bucket, padding at most 15 rows past 16."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return [*small, *range(16, max_num_seqs, 16), max_num_seqs]


class DecodeGraphs:
    """One runner's captured decode graphs and the paths its decode steps took."""

    def __init__(self, backend: GraphBackend, buckets: list[int]) -> None:
        self.backend, self.buckets = backend, sorted(buckets)
        self.graphs: dict[int, Graph] = {}
        self.graph_steps = 0
        """Steps replayed from a graph."""
        self.eager_steps: Counter[str] = Counter()
        """Steps run eagerly, by reason (`prefill`, `batch_size`; `lora` where the graphs were captured without LoRA layers)."""

    def capture(self, body: Callable[[int], None]) -> None:
        """Warm up and capture `body(bucket)` for every bucket, largest first, in one pool."""
        pool = self.backend.new_pool()
        for bucket in reversed(self.buckets):
            self.backend.warm_up(partial(body, bucket))
            self.graphs[bucket] = self.backend.capture(partial(body, bucket), pool)

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding `num_seqs` sequences (None: more than the largest)."""
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def replay(self, bucket: int) -> None:
        self.graphs[bucket].replay()
        self.graph_steps += 1

    def count_eager(self, reason: str) -> None:
        self.eager_steps[reason] += 1

    def paths(self) -> tuple[tuple[str, int], ...]:
        """("graph", replayed steps), then ("eager:<reason>", steps) by reason, sorted."""
        eager = sorted((f"eager:{r}", n) for r, n in self.eager_steps.items())
        return (("graph", self.graph_steps), *eager)


def logits_head(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model's head as its causal-LM forward applies it to final hidden states: the output
    embeddings, then Gemma's final logit soft-capping where the config sets one."""
    lm_head = model.get_output_embeddings()  # type: ignore[operator]
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)  # type: ignore[union-attr, operator]

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = lm_head(hidden)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    return head


HEAD_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config fields of models whose causal-LM forward scales logits in ways `logits_head` does not
(Cohere, Granite, ...): such models keep eager decode steps."""


def why_not_graphable(model: torch.nn.Module, static_decodes: bool) -> str | None:
    """Why this model's decode steps cannot be replayed from graphs (None: they can)."""
    if not static_decodes:
        return (
            "its attention backend builds decode metadata per step (sdpa's length groups); "
            "use a backend that reads the step's flat tables"
        )
    config = model.config.get_text_config()  # type: ignore[union-attr, operator]
    if scaled := [name for name in HEAD_SCALES if getattr(config, name, None) not in (None, 1)]:
        return f"its head scales logits ({', '.join(scaled)}), which the graphs' head does not"
    if not hasattr(model, "get_decoder"):
        return "it has no decoder module to capture apart from its head"
    return None

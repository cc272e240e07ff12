"""Attention steps built by hand, as the engine builds them: sequences on scattered KV blocks
(block 0 kept free, as the engine's null block), optionally sharing their first blocks (a
prefix-cache hit), a float or int8 cache with random keys and values written through the
cache's own `write_slots`, and the step's metadata from `build_step_inputs`."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from serve.core.scheduler import ScheduledChunk, SchedulerOutput
from serve.model.attention import AttentionBackend, AttentionMetadata
from serve.model.input_buffers import BufferLimits, StepBuffers
from serve.model.kv_cache import KVLayout, KVTensor, allocate, write_slots
from serve.model.sdpa_attention import ReferenceBackend
from serve.model.step_inputs import build_step_inputs


@dataclass(frozen=True)
class Shape:
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class Step:
    q: torch.Tensor
    k_cache: KVTensor
    v_cache: KVTensor
    meta: AttentionMetadata

    def attend(
        self, backend: AttentionBackend, window: int | None = None, scale: float = 0.25
    ) -> torch.Tensor:
        return backend.attend(self.q, self.k_cache, self.v_cache, self.meta, scale, window)

    def reference(self, window: int | None = None, scale: float = 0.25) -> torch.Tensor:
        return self.attend(ReferenceBackend(), window, scale)


def make_step(
    sequences: list[tuple[int, int]],
    shape: Shape = Shape(),
    backend: AttentionBackend | None = None,
    shared_blocks: int = 0,
    seed: int = 0,
    device: str = "cpu",
) -> Step:
    """A step computing `n` tokens after `cached` ones for each (cached, n) of `sequences` (the
    step puts the decodes first, as the engine does); with `shared_blocks`, every sequence after the first whose cache covers them
    starts with the first sequence's first `shared_blocks` blocks."""
    rng, bs = random.Random(seed), shape.block_size
    torch.manual_seed(seed)
    counts = [-(-(cached + n) // bs) for cached, n in sequences]
    free = list(range(1, sum(counts) + 8))  # block 0: the null block
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(c)] for c in counts]
    for table, (cached, _) in zip(tables[1:], sequences[1:]):
        if cached >= shared_blocks * bs:
            table[:shared_blocks] = tables[0][:shared_blocks]
    layout = KVLayout(1, shape.kv_heads, shape.head_dim, shape.dtype, shape.kv_cache_dtype)  # type: ignore[arg-type]
    smoothing = {0: torch.exp2(torch.randint(-2, 3, (shape.head_dim,)).float())}
    ((k, v),) = allocate(layout, sum(counts) + 8, bs, torch.device(device), smoothing)
    for table, (cached, n) in zip(tables, sequences):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(cached + n)])
        for cache in (k, v):
            x = torch.randn(len(slots), shape.kv_heads, shape.head_dim).to(shape.dtype)
            write_slots(cache, slots.to(device), x.to(device))
    chunks = [
        ScheduledChunk(str(i), [0] * n, cached, table, sample=True)
        for i, ((cached, n), table) in enumerate(zip(sequences, tables))
    ]
    backend = backend or ReferenceBackend()
    limits = BufferLimits(256, 16, max(counts) + 2)
    buffers = StepBuffers(limits, bs, torch.device(device))
    inputs = build_step_inputs(SchedulerOutput(chunks), buffers, [(k, v)], backend)
    rows = sum(n for _, n in sequences)
    q = torch.randn(rows, shape.heads, shape.head_dim).to(shape.dtype).to(device)
    return Step(q, k, v, inputs.meta)

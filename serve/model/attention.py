"""Paged attention plugged into transformers' attention interface.

Model: the runner calls the HF model on one flattened (ragged) row of every scheduled token
inside `step_context(AttentionMetadata)` (the step's forward context, as vLLM's: a ContextVar, so
the model's own call signature stays tensors only and `torch.compile` sees no Python metadata).
transformers calls `paged_attention` in every attention layer with that row's queries, keys and
values (RoPE applied). It writes the new keys and values into their cache slots
(`slot_mapping`), then attends each sequence's queries over that sequence's blocks
(`block_tables`, `seq_lens`), causally within the step's chunk. A sliding-window layer (Gemma 3's
local layers: transformers passes `sliding_window`) lets the query at position p see keys at
p - window + 1 .. p only, as transformers' `sliding_window_overlay` does; every backend applies
the window, and keys before it are not read. Under `torch.compile` the layer is the opaque custom
op `workbench::paged_attention`.

Backends implement `attend`: `SDPABackend` (`serve/model/sdpa_attention.py`) gathers each sequence's blocks and runs
`scaled_dot_product_attention` (decoding sequences in batched calls of similar lengths), on any
device; `PagedCPUBackend` (`serve/model/cpu_attention.py`) reads K/V from their blocks in place
with C kernels (the decodes, and every prefill chunk of the step, each in one call a layer);
`ReferenceBackend` (beside `SDPABackend`) is a plain per-sequence loop, kept as the readable
definition to test against.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch
from transformers import AttentionInterface

from serve.core.step_scope import step_scope
from serve.model.kv_cache import KVTensor, write_slots
from serve.model.opaque_ops import define_opaque_op

ATTENTION_NAME = "workbench_paged"


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence of the step: its queries are rows [start, end) of the flat batch."""

    start: int
    end: int
    seq_len: int
    """Tokens in context once this step's are written (positions 0 .. seq_len - 1)."""
    block_ids: torch.Tensor


@dataclass(frozen=True)
class PrefillTable:
    """A step's prefill chunks as one table (int64, contiguous): what a kernel attending every
    chunk in one call reads."""

    starts: torch.Tensor
    """[P]: first flat row of each chunk's queries."""
    query_lens: torch.Tensor
    """[P]: its queries, the last `query_lens` positions of its context."""
    seq_lens: torch.Tensor
    """[P]: tokens in context once this step's are written."""
    block_tables: torch.Tensor
    """[P, max_blocks]: its blocks, padded with block 0 (the null block)."""

    @staticmethod
    def of(prefills: list[SequenceSlice]) -> PrefillTable:
        def as_long(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long)

        tables = [s.block_ids.to("cpu", torch.long) for s in prefills]
        return PrefillTable(
            as_long([s.start for s in prefills]),
            as_long([s.end - s.start for s in prefills]),
            as_long([s.seq_len for s in prefills]),
            torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).contiguous(),
        )


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences computing exactly one token, of similar lengths, attended in one batched call."""

    rows: torch.Tensor
    """[S_g]: flat row of each sequence's query."""
    block_tables: torch.Tensor
    """[S_g, max_blocks]: their blocks, padded with block 0 (the null block)."""
    mask: torch.Tensor | None
    """[S_g, 1, 1, max_blocks * block_size]: True where a gathered slot is in context (made by
    `decode_groups` for the SDPA backend; None where the backend reads `seq_lens` instead)."""
    seq_lens: torch.Tensor
    """[S_g]: tokens in context of each sequence, this step's included."""
    first_row: int | None = None
    """When `rows` are consecutive and ascending (the usual case: decodes come first in a step),
    the first; the group's queries and outputs are then a slice of the batch, not gathered."""

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rows of `x`."""
        if self.first_row is not None:
            return x[self.first_row : self.first_row + len(self.rows)]
        return x.index_select(0, self.rows)

    def put(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """Write the group's rows of `out`."""
        if self.first_row is not None:
            out[self.first_row : self.first_row + len(self.rows)] = values
        else:
            out.index_copy_(0, self.rows, values)


@dataclass(frozen=True)
class AttentionMetadata:
    kv_caches: list[tuple[KVTensor, KVTensor]]
    """Per layer: K and V, each [num_blocks, block_size, kv_heads, head_dim] (float, or int8
    with scales: `serve/model/kv_cache.py`)."""
    slot_mapping: torch.Tensor
    """[T]: flat cache slot (block_id * block_size + offset) of each new token."""
    prefills: list[SequenceSlice]
    """Sequences computing more than one token this step."""
    decodes: list[DecodeGroup]
    """Sequences computing one token, grouped by length (`decode_group_size` per group)."""
    backend: AttentionBackend
    # The step as flat tables over all its sequences, decodes first: views of the runner's
    # persistent buffers (`serve/model/input_buffers.py`), whose shapes follow only from the
    # step's counts, so a captured decode graph replays against the same tensors. Metadata made
    # by hand (tests, benchmarks) may leave them None; `build_step_inputs` always sets them.
    query_start_loc: torch.Tensor | None = None
    """[S + 1]: first flat row of each sequence's queries, then T."""
    seq_lens: torch.Tensor | None = None
    """[S]: tokens in context of each sequence once this step's are written."""
    block_tables: torch.Tensor | None = None
    """[S, max_blocks_per_seq]: each sequence's blocks, padded with the null block 0."""
    positions: torch.Tensor | None = None
    """[T]: position of each flat row."""
    query_lens: torch.Tensor | None = None
    """[S]: queries of each sequence this step."""
    num_decodes: int = 0
    """Sequences 0 .. num_decodes - 1 compute one token each, at rows 0 .. num_decodes - 1."""
    max_query_len: int = 0

    @cached_property
    def prefill_table(self) -> PrefillTable:
        """`prefills` as one table, built by the first layer that asks and kept for the step
        (slices of the flat tables where the step has them)."""
        if self.query_start_loc is None or self.query_lens is None or self.seq_lens is None:
            return PrefillTable.of(self.prefills)
        assert self.block_tables is not None
        end = self.num_decodes + len(self.prefills)
        rows = slice(self.num_decodes, end)
        return PrefillTable(
            self.query_start_loc[rows],
            self.query_lens[rows],
            self.seq_lens[rows],
            self.block_tables[rows],
        )


class AttentionBackend(Protocol):
    decode_group_size: int | None
    """Decoding sequences per `DecodeGroup` (sorted by length); None: all in one group."""
    static_decodes: bool
    """Decode attention reads only tensors of the metadata whose shapes follow from the step's
    counts (no per-step Python structure), so a captured decode graph can replay it."""

    def attend(
        self,
        q: torch.Tensor,
        k_cache: KVTensor,
        v_cache: KVTensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim], after the step's K/V are written;
        `window`: the layer's sliding window (None: global attention)."""
        ...


_step_meta: ContextVar[AttentionMetadata | None] = ContextVar("attention_metadata", default=None)


def step_context(meta: AttentionMetadata) -> AbstractContextManager[None]:
    """Make `meta` the attention metadata of every layer called inside, on this thread."""
    return step_scope(_step_meta, meta)


def _attend_layer(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """[1, H, T, D] queries (and KV-head keys/values) in, [1, T, H, D] out."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    return attend_tokens(q, k, v, layer_idx, scale, window)[None]


def attend_tokens(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """One layer's paged attention for the step's token rows: q [T, H, D], k and v
    [T, KV heads, D] in (written into their slots first), [T, H, D] out."""
    meta = _step_meta.get()
    if meta is None:
        raise RuntimeError(
            "paged attention was called outside step_context(); run the model through ModelRunner"
        )
    k_cache, v_cache = meta.kv_caches[layer_idx]
    write_slots(k_cache, meta.slot_mapping, k)
    write_slots(v_cache, meta.slot_mapping, v)
    return meta.backend.attend(q, k_cache, v_cache, meta, scale, window)


def _paged_attention_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    window: int,
) -> torch.Tensor:
    return _attend_layer(query, key, value, layer_idx, scale, window or None)


def _paged_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scale: float,
    window: int,
) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


paged_attention_op = define_opaque_op(
    "paged_attention(Tensor query, Tensor key, Tensor value, int layer_idx, float scale, "
    "int window) -> Tensor",
    _paged_attention_kernel,
    _paged_attention_fake,
)
"""The layer as one opaque op for `torch.compile` (it writes the step's KV cache slots, which
are not arguments: each layer's cache is read only by that layer's own op); window 0: none."""


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [1, H, T, D] in, [1, T, H, D] out."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer_idx = int(module.layer_idx)  # type: ignore[arg-type]  # HF attention modules: an int
    window = kwargs.get("sliding_window") or None
    if torch.compiler.is_compiling():
        return paged_attention_op(query, key, value, layer_idx, scale, window or 0), None
    return _attend_layer(query, key, value, layer_idx, scale, window), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)

"""Flatten a `SchedulerOutput` into the tensors of one forward pass.

Model: chunk i occupies rows [r_i, r_i + n_i) of one flat row of tokens. Logits are kept only at
the rows someone needs: the last row of a chunk that samples, and every row of a chunk whose
request asked for prompt logprobs. `sample_rows` and `prompt_rows` index into those kept logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.core.kv_cache_manager import cdiv
from serve.core.scheduler import ScheduledChunk, SchedulerOutput
from serve.model.attention import AttentionBackend, AttentionMetadata, DecodeGroup, SequenceSlice
from serve.model.input_buffers import StepBuffers, StepCounts, decodes_first
from serve.model.kv_cache import KVTensor


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    """Flat rows whose logits are computed: ascending and distinct (T of them: every row)."""
    sample_rows: dict[str, int]
    """request id -> index (into the kept logits) of the row it samples from."""
    prompt_rows: dict[str, tuple[int, int]]
    """request id -> (first index into the kept logits, count) for prompt logprobs."""
    adapter_rows: list[tuple[int, torch.Tensor]]
    """(adapter version, flat rows of its tokens) for each adapter the step uses."""


def _logits_rows(
    chunks: list[ScheduledChunk],
) -> tuple[list[int], dict[str, int], dict[str, tuple[int, int]]]:
    rows: list[int] = []
    sample_rows: dict[str, int] = {}
    prompt_rows: dict[str, tuple[int, int]] = {}
    start = 0
    for chunk in chunks:
        n = len(chunk.token_ids)
        if chunk.prompt_logprobs:
            first = chunk.first_logprob_row
            prompt_rows[chunk.request_id] = (len(rows), n - first)
            rows.extend(range(start + first, start + n))
            if chunk.sample:
                sample_rows[chunk.request_id] = len(rows) - 1
        elif chunk.sample:
            sample_rows[chunk.request_id] = len(rows)
            rows.append(start + n - 1)
        start += n
    return rows, sample_rows, prompt_rows


def decode_groups(
    rows: list[int],
    tables: list[list[int]],
    lens: list[int],
    block_size: int,
    group_size: int | None,
    device: torch.device,
) -> list[DecodeGroup]:
    """Decoding sequences (flat query row, block table, tokens in context) sorted by length and
    cut into groups of `group_size` (None: one group in the step's order, which padding does not
    concern), block tables padded with block 0."""
    order = list(range(len(rows)))
    if group_size is not None:
        order.sort(key=lambda i: lens[i])
    size = group_size or max(len(order), 1)
    groups = []
    for start in range(0, len(order), size):
        members = order[start : start + size]
        width = max(len(tables[i]) for i in members)
        padded = [tables[i] + [0] * (width - len(tables[i])) for i in members]
        seq_lens = torch.tensor([lens[i] for i in members], device=device)
        mask = torch.arange(width * block_size, device=device)[None, :] < seq_lens[:, None]
        member_rows = [rows[i] for i in members]
        consecutive = member_rows == list(range(member_rows[0], member_rows[0] + len(members)))
        groups.append(
            DecodeGroup(
                rows=torch.tensor(member_rows, dtype=torch.long, device=device),
                block_tables=torch.tensor(padded, dtype=torch.long, device=device),
                mask=mask[:, None, None, :],
                seq_lens=seq_lens,
                first_row=member_rows[0] if consecutive else None,
            )
        )
    return groups


def build_step_inputs(
    out: SchedulerOutput,
    buffers: StepBuffers,
    kv_caches: list[tuple[KVTensor, KVTensor]],
    backend: AttentionBackend,
) -> StepInputs:
    """The step's inputs: its chunks, decodes first, written into the persistent `buffers`;
    the tensors the forward reads are views of them."""
    chunks = decodes_first(out.chunks)
    counts = buffers.fill(chunks)
    meta = attention_metadata(chunks, counts, buffers, kv_caches, backend)
    rows, sample_rows, prompt_rows = _logits_rows(chunks)
    adapter_rows: dict[int, list[int]] = {}
    row = 0
    for chunk in chunks:
        n = len(chunk.token_ids)
        if chunk.adapter_id is not None:
            adapter_rows.setdefault(chunk.adapter_id, []).extend(range(row, row + n))
        row += n

    def as_long(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=buffers.device)

    t = counts.num_tokens
    return StepInputs(
        buffers.view("input_ids", t),
        buffers.view("positions", t),
        meta,
        as_long(rows),
        sample_rows,
        prompt_rows,
        [(version, as_long(r)) for version, r in adapter_rows.items()],
    )


def attention_metadata(
    chunks: list[ScheduledChunk],
    counts: StepCounts,
    buffers: StepBuffers,
    kv_caches: list[tuple[KVTensor, KVTensor]],
    backend: AttentionBackend,
) -> AttentionMetadata:
    """The step's attention metadata over the filled `buffers` (`chunks` decodes first)."""
    s, nd, bs = counts.num_seqs, counts.num_decodes, buffers.block_size
    tables, seq_lens = buffers.view("block_tables", s), buffers.view("seq_lens", s)
    prefills, row = [], nd
    for i in range(nd, s):
        chunk = chunks[i]
        n, seq_len = len(chunk.token_ids), chunk.start_pos + len(chunk.token_ids)
        prefills.append(SequenceSlice(row, row + n, seq_len, tables[i, : cdiv(seq_len, bs)]))
        row += n
    if backend.decode_group_size is None:
        group = DecodeGroup(
            rows=buffers.rows[:nd],
            block_tables=tables[:nd],
            mask=None,
            seq_lens=seq_lens[:nd],
            first_row=0,
        )
        decodes = [group] if nd else []
    else:
        decodes = decode_groups(
            list(range(nd)),
            [c.block_ids for c in chunks[:nd]],
            [c.start_pos + 1 for c in chunks[:nd]],
            bs,
            backend.decode_group_size,
            buffers.device,
        )
    return AttentionMetadata(
        kv_caches=kv_caches,
        slot_mapping=buffers.view("slot_mapping", counts.num_tokens),
        prefills=prefills,
        decodes=decodes,
        backend=backend,
        query_start_loc=buffers.view("query_start_loc", s + 1),
        seq_lens=seq_lens,
        block_tables=tables,
        positions=buffers.view("positions", counts.num_tokens),
        query_lens=buffers.view("query_lens", s),
        num_decodes=nd,
        max_query_len=counts.max_query_len,
    )

"""Persistent step inputs: what a fill writes equals the flattened chunks, block tables stay
padded with the null block, the buffers never move, and the forward never syncs with the host."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.core.scheduler import ScheduledChunk
from serve.model.input_buffers import BufferLimits, StepBuffers, decodes_first
from tests.serve.conftest import PAGED_CPU

BLOCK = 4


def random_chunks(rng: random.Random, n: int) -> list[ScheduledChunk]:
    chunks = []
    next_block = 1
    for i in range(n):
        start = rng.randrange(0, 40)
        tokens = 1 if rng.random() < 0.5 else rng.randrange(2, 12)
        blocks = -(-(start + tokens) // BLOCK)
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        ids = [rng.randrange(1, 1000) for _ in range(tokens)]
        chunks.append(ScheduledChunk(f"r{i}", ids, start, table, sample=True))
    return chunks


def flattened(chunks: list[ScheduledChunk]) -> dict[str, list[int]]:
    """The step's inputs as the engine built them before the persistent buffers."""
    out: dict[str, list[int]] = {"ids": [], "positions": [], "slots": [], "starts": []}
    for c in chunks:
        out["starts"].append(len(out["ids"]))
        out["ids"] += c.token_ids
        span = range(c.start_pos, c.start_pos + len(c.token_ids))
        out["positions"] += span
        out["slots"] += [c.block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in span]
    return out


def buffers(width: int = 16) -> StepBuffers:
    return StepBuffers(BufferLimits(256, 16, width), BLOCK, torch.device("cpu"))


@pytest.mark.parametrize("seed", range(5))
def test_fill_equals_the_flattened_chunks_decodes_first(seed: int) -> None:
    rng = random.Random(seed)
    b = buffers()
    for _ in range(3):  # refills over earlier steps' values
        chunks = decodes_first(random_chunks(rng, rng.randrange(1, 12)))
        counts = b.fill(chunks)
        ref = flattened(chunks)
        t, s = counts.num_tokens, counts.num_seqs
        assert b.view("input_ids", t).tolist() == ref["ids"]
        assert b.view("positions", t).tolist() == ref["positions"]
        assert b.view("slot_mapping", t).tolist() == ref["slots"]
        assert b.view("query_start_loc", s + 1).tolist() == [*ref["starts"], t]
        assert b.view("seq_lens", s).tolist() == [c.start_pos + len(c.token_ids) for c in chunks]
        assert b.view("query_lens", s).tolist() == [len(c.token_ids) for c in chunks]
        tables = b.view("block_tables", s).tolist()
        assert tables == [c.block_ids + [0] * (16 - len(c.block_ids)) for c in chunks]
        decodes = [len(c.token_ids) == 1 for c in chunks]
        assert counts.num_decodes == sum(decodes) and not any(decodes[counts.num_decodes :])


def test_decodes_first_keeps_each_kind_in_the_schedulers_order() -> None:
    def chunk(rid: str, n: int) -> ScheduledChunk:
        return ScheduledChunk(rid, [1] * n, 0, [1, 2, 3], sample=True)

    chunks = [chunk("p1", 5), chunk("d1", 1), chunk("p2", 3), chunk("d2", 1)]
    assert [c.request_id for c in decodes_first(chunks)] == ["d1", "d2", "p1", "p2"]
    ordered = [chunk("d1", 1), chunk("p1", 5)]
    assert decodes_first(ordered) is ordered


def test_a_shorter_table_leaves_only_null_blocks_after_it() -> None:
    b = buffers(width=8)
    b.fill([ScheduledChunk("a", [1], 27, [5, 6, 7, 8, 9, 10, 11], sample=True)])
    b.fill([ScheduledChunk("b", [1], 5, [3, 4], sample=True)])
    assert b.view("block_tables", 1).tolist() == [[3, 4, 0, 0, 0, 0, 0, 0]]


def test_padding_a_decode_bucket_points_every_extra_row_at_the_null_block() -> None:
    b = buffers(width=4)
    b.fill([ScheduledChunk(f"{i}", [9], 6, [7, 8, 9, 10], sample=True) for i in range(5)])
    b.fill([ScheduledChunk("a", [3], 5, [2, 3], sample=True)])
    b.pad_decodes(1, 4)
    assert b.view("slot_mapping", 4).tolist() == [3 * BLOCK + 1, 0, 0, 0]
    assert b.view("seq_lens", 4).tolist() == [6, 1, 1, 1]
    assert b.view("query_start_loc", 5).tolist() == [0, 1, 2, 3, 4]
    assert b.view("block_tables", 4).tolist() == [[2, 3, 0, 0], [0] * 4, [0] * 4, [0] * 4]


def test_a_step_larger_than_the_buffers_is_refused_naming_the_limits() -> None:
    b = StepBuffers(BufferLimits(8, 2, 4), BLOCK, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds the step buffers"):
        b.fill([ScheduledChunk("a", [1] * 9, 0, [1, 2, 3], sample=True)])


def engine(model_dir: Path, backend: str) -> LLMEngine:
    return LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cpu", attention_backend=backend),
        CacheConfig(block_size=16, num_blocks=64),
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
    )


def test_step_inputs_are_views_of_buffers_that_never_move(model_dirs: dict[str, Path]) -> None:
    e = engine(model_dirs["llama"], "auto")
    for i in range(3):
        e.add_request(str(i), [5 + i, 6, 7, 8, 9][: 3 + i], SamplingParams(max_tokens=4))
    seen: set[tuple[int, ...]] = set()
    original = e.runner.forward

    def forward(inputs: Any, lora: Any = None) -> torch.Tensor:
        m = inputs.meta
        tensors = (inputs.input_ids, inputs.positions, m.slot_mapping, m.seq_lens, m.block_tables)
        seen.add(tuple(x.data_ptr() for x in tensors))
        return original(inputs, lora)

    e.runner.forward = forward  # type: ignore[method-assign]
    while e.has_unfinished_requests():
        e.step()
    assert len(seen) == 1


class NoHostSync(TorchDispatchMode):
    """Fails on any op that reads a tensor's value on the host (a device sync on CUDA)."""

    FORBIDDEN = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::equal")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name in self.FORBIDDEN:
            raise AssertionError(f"host sync inside the forward: {func._schema.name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["sdpa", PAGED_CPU])
def test_the_forward_reads_no_tensor_value_on_the_host(
    model_dirs: dict[str, Path], backend: str
) -> None:
    """Prefill and decode steps, one batch of both: the forward's ops never call `item`,
    `_local_scalar_dense`, `nonzero` or `equal` (what a CUDA graph could not capture)."""
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():
        torch.ones(1).item()  # the mode itself sees what it forbids
    e = engine(model_dirs["llama"], backend)
    original = e.runner.forward
    calls = 0

    def forward(inputs: Any, lora: Any = None) -> torch.Tensor:
        nonlocal calls
        calls += 1
        with NoHostSync():
            return original(inputs, lora)

    e.runner.forward = forward  # type: ignore[method-assign]
    e.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=5))
    e.step()
    e.add_request("b", list(range(5, 30)), SamplingParams(max_tokens=3))
    while e.has_unfinished_requests():
        e.step()
    assert calls >= 5

"""The paged-cpu decode kernel against the reference backend, on scattered blocks; and how the
engine chooses a backend where the kernel cannot be built."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from serve.core.config import CacheConfig, ModelConfig
from serve.engine.llm_engine import LLMEngine
from serve.model import cpu_attention
from serve.model.attention import AttentionMetadata, DecodeGroup
from serve.model.sdpa_attention import ReferenceBackend
from serve.model.step_inputs import decode_groups
from tests.serve.conftest import needs_c_compiler


def scattered_caches(
    lens: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Random K and V caches, and a block table per sequence of `lens` tokens: its blocks drawn
    at random from a shuffled pool (5 blocks spare)."""
    rng = random.Random(0)
    counts = [-(-n // block_size) for n in lens]
    free = list(range(sum(counts) + 5))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(c)] for c in counts]
    shape = (sum(counts) + 5, block_size, kv_heads, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), tables


def scattered_decode(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeGroup]:
    """Random q and caches on scattered blocks (`scattered_caches`); the decode group built as a
    step builds it."""
    k, v, tables = scattered_caches(lens, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    rows = list(range(len(lens)))
    (group,) = decode_groups(rows, tables, lens, block_size, None, torch.device("cpu"))
    return q, k, v, group


LENS = [1, 7, 8, 9, 16, 17, 100, 263]
FEW = [7, 100, 263]
"""Fewer than 4 sequences a thread at any thread count: the kernel's (sequence, KV head) items."""
MANY = LENS * max(5, torch.get_num_threads())
"""At least 4 a thread: one item per sequence, every head of a cached row read together."""
DECOMPOSITIONS = pytest.mark.parametrize("lens", [FEW, MANY], ids=["kv-head-items", "seq-items"])


@needs_c_compiler
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(8, 4, 64, 8), (4, 4, 32, 16), (9, 3, 80, 8), (16, 1, 128, 5), (4, 1, 256, 16)],
)
@DECOMPOSITIONS
def test_decode_kernel_equals_the_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int, lens: list[int]
) -> None:
    q, k, v, group = scattered_decode(lens, heads, kv_heads, head_dim, block_size, torch.float32)
    meta = AttentionMetadata([(k, v)], torch.empty(0), [], [group], ReferenceBackend())
    expected = ReferenceBackend().attend(q, k, v, meta, head_dim**-0.5)
    got = cpu_attention.PagedCPUBackend().attend(q, k, v, meta, head_dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_c_compiler
@pytest.mark.parametrize("window", [1, 7, 8, 50, 1000])
@DECOMPOSITIONS
def test_sliding_window_decode_kernel_equals_the_reference(window: int, lens: list[int]) -> None:
    q, k, v, group = scattered_decode(lens, 4, 1, 256, 8, torch.float32)
    meta = AttentionMetadata([(k, v)], torch.empty(0), [], [group], ReferenceBackend())
    expected = ReferenceBackend().attend(q, k, v, meta, 0.0625, window)
    got = cpu_attention.PagedCPUBackend().attend(q, k, v, meta, 0.0625, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if window < 263:  # the window changes the answer of the long sequences
        full = ReferenceBackend().attend(q, k, v, meta, 0.0625)
        assert not torch.allclose(full[-1], expected[-1])


def test_sliding_window_in_sdpa_equals_the_reference_for_prefill_chunks_and_decodes() -> None:
    """Chunks that start inside, at and past the window; decodes shorter and longer than it."""
    from serve.model.attention import SequenceSlice
    from serve.model.sdpa_attention import SDPABackend

    torch.manual_seed(0)
    window, block_size = 12, 4
    shape = (128, block_size, 2, 16)
    k, v = torch.randn(shape), torch.randn(shape)
    chunks = [(0, 5), (0, 30), (9, 6), (20, 3), (12, 12)]  # (computed before, this chunk)
    prefills, row, next_block = [], 0, 0
    for done, n in chunks:
        blocks = torch.arange(next_block, next_block + -(-(done + n) // block_size))
        next_block += len(blocks)
        prefills.append(SequenceSlice(row, row + n, done + n, blocks))
        row += n
    lens = [3, 12, 13, 40]
    tables = [list(range(next_block + 10 * i, next_block + 10 * i + 10)) for i in range(4)]
    rows = list(range(row, row + len(lens)))
    groups = decode_groups(rows, tables, lens, block_size, 2, torch.device("cpu"))
    q = torch.randn(row + len(lens), 4, 16)
    meta = AttentionMetadata([(k, v)], torch.empty(0), prefills, groups, ReferenceBackend())
    expected = ReferenceBackend().attend(q, k, v, meta, 0.25, window)
    torch.testing.assert_close(SDPABackend().attend(q, k, v, meta, 0.25, window), expected)
    assert not torch.allclose(ReferenceBackend().attend(q, k, v, meta, 0.25), expected)


@pytest.mark.parametrize("layout", ["decodes_first", "decodes_after_a_prefill", "interleaved"])
@pytest.mark.parametrize("backend", ["sdpa", "paged-cpu"])
def test_decode_rows_anywhere_in_the_step_equal_the_reference(layout: str, backend: str) -> None:
    """Decode groups read as a slice of the batch (rows consecutive: the whole batch, or after a
    prefill) or gathered (rows around a prefill) give the reference's outputs."""
    from serve.model.attention import SequenceSlice
    from serve.model.sdpa_attention import SDPABackend

    if backend == "paged-cpu" and cpu_attention.load_kernel() is None:
        pytest.skip("no C compiler")
    torch.manual_seed(0)
    block_size, lens = 4, [3, 12, 13, 40]
    k, v = torch.randn(64, block_size, 2, 16), torch.randn(64, block_size, 2, 16)
    prefill_rows = {"decodes_first": None, "decodes_after_a_prefill": 0, "interleaved": 1}
    first = prefill_rows[layout]
    prefills = [] if first is None else [SequenceSlice(first, first + 5, 5, torch.arange(2))]
    taken = set(range(first, first + 5)) if first is not None else set()
    rows = [r for r in range(len(lens) + len(taken)) if r not in taken]
    tables = [list(range(2 + 12 * i, 2 + 12 * i + 12)) for i in range(len(lens))]
    impl = SDPABackend() if backend == "sdpa" else cpu_attention.PagedCPUBackend()
    groups = decode_groups(
        rows, tables, lens, block_size, impl.decode_group_size, torch.device("cpu")
    )
    consecutive = layout != "interleaved"
    assert all((g.first_row is not None) == consecutive for g in groups)
    q = torch.randn(len(rows) + len(taken), 4, 16)
    meta = AttentionMetadata([(k, v)], torch.empty(0), prefills, groups, ReferenceBackend())
    expected = ReferenceBackend().attend(q, k, v, meta, 0.25)
    torch.testing.assert_close(impl.attend(q, k, v, meta, 0.25), expected, rtol=1e-5, atol=1e-5)


@needs_c_compiler
def test_bfloat16_decode_kernel_is_float32_math_rounded_once() -> None:
    """bf16 inputs, float32 accumulation, one rounding of the output: within bf16's precision
    of the reference computed in float32 from the same bf16 inputs."""
    q, k, v, group = scattered_decode(
        [3, 50, 129] * 3 * torch.get_num_threads(), 8, 4, 64, 8, torch.bfloat16
    )
    meta = AttentionMetadata([(k, v)], torch.empty(0), [], [group], ReferenceBackend())
    expected = ReferenceBackend().attend(q, k, v, meta, 0.125)
    got = cpu_attention.PagedCPUBackend().attend(q, k, v, meta, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    cpu_attention.load_kernel.cache_clear()
    yield
    cpu_attention.load_kernel.cache_clear()


def test_without_a_compiler_auto_keeps_sdpa_and_paged_cpu_names_the_fix(
    no_compiler: None, model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    def engine(backend: str) -> LLMEngine:
        config = ModelConfig(str(model_dirs["llama"]), dtype="float32", attention_backend=backend)
        return LLMEngine(config, CacheConfig(num_blocks=16))

    assert type(engine("auto").runner.backend).__name__ == "SDPABackend"
    assert "no C compiler '/nonexistent/cc'" in caplog.text
    with pytest.raises(ValueError, match=r"needs a C compiler.*--attention-backend sdpa"):
        engine("paged-cpu")


@needs_c_compiler
def test_auto_picks_the_kernel_on_the_cpu(model_dirs: dict[str, Path]) -> None:
    config = ModelConfig(str(model_dirs["llama"]), dtype="float32", device="cpu")
    engine = LLMEngine(config, CacheConfig(num_blocks=16))
    assert isinstance(engine.runner.backend, cpu_attention.PagedCPUBackend)
    fp16 = LLMEngine(
        ModelConfig(str(model_dirs["llama"]), dtype="float16", device="cpu"),
        CacheConfig(num_blocks=16),
    )
    assert type(fp16.runner.backend).__name__ == "SDPABackend"

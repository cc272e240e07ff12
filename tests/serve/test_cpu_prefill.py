"""The paged-cpu prefill kernel (`serve/model/kernels/paged_prefill.c`) against the reference
backend: whole prompts and chunks of longer contexts, on scattered blocks, with and without a
sliding window, in float32, bfloat16 and over int8 caches, at each SIMD width it compiles to; and
where it hands chunks to SDPA instead."""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from serve.model import cpu_attention
from serve.model.attention import AttentionMetadata, SequenceSlice
from serve.model.sdpa_attention import ReferenceBackend, SDPABackend
from serve.model.step_inputs import decode_groups
from tests.serve.conftest import needs_c_compiler
from tests.serve.test_cpu_attention import scattered_caches
from tests.serve.test_kv_cache_int8 import as_int8

pytestmark = needs_c_compiler
needs_prefill_kernel = pytest.mark.skipif(
    cpu_attention.load_prefill_kernel() is None,
    reason="the engine keeps SDPA for prefills here (no C compiler, or a CPU without FMA)",
)


@pytest.fixture(autouse=True)
def sdpa_prefills(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The chunks handed to SDPA instead of the kernel: none, unless a test takes them."""
    handed: list[int] = []
    sdpa = SDPABackend.attend_prefills

    def counted(*args: Any, **kwargs: Any) -> None:
        handed.append(len(args[3].prefills))
        sdpa(*args, **kwargs)

    monkeypatch.setattr(SDPABackend, "attend_prefills", staticmethod(counted))
    yield handed
    if cpu_attention.load_prefill_kernel() is not None:
        assert not handed, f"prefill chunks went to SDPA: {handed}"


Chunk = tuple[int, int]
"""(tokens computed before this step, tokens computed in it)."""


def scattered_step(
    chunks: list[Chunk],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    decode_lens: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random queries and caches on scattered blocks (`scattered_caches`); prefill chunks first in
    the flat batch (one spare row before them), decodes after."""
    torch.manual_seed(0)
    lens = [done + n for done, n in chunks] + list(decode_lens)
    k, v, tables = scattered_caches(lens, kv_heads, head_dim, block_size, dtype)
    prefills, row = [], 1
    for (done, n), table in zip(chunks, tables):
        prefills.append(SequenceSlice(row, row + n, done + n, torch.tensor(table)))
        row += n
    rows = list(range(row, row + len(decode_lens)))
    groups = decode_groups(
        rows, tables[len(chunks) :], list(decode_lens), block_size, None, torch.device("cpu")
    )
    q = torch.randn(row + len(decode_lens), heads, head_dim).to(dtype)
    meta = AttentionMetadata([(k, v)], torch.empty(0), prefills, groups, ReferenceBackend())
    return q, k, v, meta


def computed_rows(meta: AttentionMetadata) -> torch.Tensor:
    rows = [torch.arange(s.start, s.end) for s in meta.prefills]
    rows += [g.rows for g in meta.decodes]
    return torch.cat(rows)


def assert_equals_reference(
    backend: cpu_attention.PagedCPUBackend,
    step: tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata],
    scale: float,
    window: int | None = None,
    tolerance: float = 1e-5,
) -> None:
    q, k, v, meta = step
    rows = computed_rows(meta)
    expected = ReferenceBackend().attend(q, k, v, meta, scale, window)[rows]
    got = backend.attend(q, k, v, meta, scale, window)[rows]
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


WHOLE_PROMPTS = [(0, 2), (0, 5), (0, 64), (0, 65), (0, 100), (0, 263)]
CHUNKS = [(16, 48), (7, 2), (100, 163), (64, 1), (250, 300)]
"""Chunks of longer contexts: their queries are the last positions, every earlier key visible."""


@needs_prefill_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(8, 4, 64, 16), (4, 4, 32, 16), (9, 3, 80, 8), (16, 1, 128, 5), (4, 1, 256, 16)],
)
@pytest.mark.parametrize("chunks", [WHOLE_PROMPTS, CHUNKS], ids=["whole", "chunked"])
def test_prefill_kernel_equals_the_reference(
    heads: int, kv_heads: int, head_dim: int, block_size: int, chunks: list[Chunk]
) -> None:
    step = scattered_step(chunks, heads, kv_heads, head_dim, block_size, decode_lens=(9, 40))
    assert_equals_reference(cpu_attention.PagedCPUBackend(), step, head_dim**-0.5)


@needs_prefill_kernel
@pytest.mark.parametrize("window", [1, 7, 16, 64, 1000])
def test_sliding_window_prefill_kernel_equals_the_reference(window: int) -> None:
    step = scattered_step(WHOLE_PROMPTS + CHUNKS, 4, 2, 64, 16)
    assert_equals_reference(cpu_attention.PagedCPUBackend(), step, 0.125, window)
    q, k, v, meta = step
    if window < 263:  # the window changes the answer of the long sequences
        full = ReferenceBackend().attend(q, k, v, meta, 0.125)
        windowed = cpu_attention.PagedCPUBackend().attend(q, k, v, meta, 0.125, window)
        assert not torch.allclose(
            full[meta.prefills[5].end - 1], windowed[meta.prefills[5].end - 1]
        )


@needs_prefill_kernel
def test_bfloat16_prefill_kernel_is_float32_math_rounded_once() -> None:
    step = scattered_step(WHOLE_PROMPTS + CHUNKS, 8, 4, 64, 16, torch.bfloat16)
    assert_equals_reference(cpu_attention.PagedCPUBackend(), step, 0.125, tolerance=1e-2)


@needs_prefill_kernel
def test_prefill_kernel_leaves_other_rows_alone() -> None:
    """Only each chunk's own rows of the output are written (decode rows by the decode kernel,
    the spare row by no one)."""
    q, k, v, meta = scattered_step([(0, 30), (5, 20)], 4, 2, 32, 16)
    out = torch.full_like(q, 7.0)
    cpu_attention.PagedCPUBackend().attend_prefills(q, k, v, meta, 0.2, out)
    rows = computed_rows(meta)
    others = torch.ones(len(q), dtype=torch.bool)
    others[rows] = False
    assert bool((out[others] == 7.0).all()) and not bool((out[rows] == 7.0).any())


def _has_avx2() -> bool:
    try:
        return platform.machine() == "x86_64" and " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx2(), reason="needs an x86 CPU with AVX2")
@pytest.mark.parametrize("march", ["haswell", "x86-64"], ids=["avx2-8-lanes", "sse-4-lanes"])
def test_prefill_kernel_at_narrower_widths_equals_the_reference(march: str) -> None:
    """The kernel compiled for AVX2 (8 lanes: tiles of 32 rows) and for plain x86-64 (4 lanes,
    as on NEON: tiles of 16 rows), as CPUs without AVX-512 run it, whatever this CPU has; the
    build without FMA says it should not be used."""
    flags = [f for f in cpu_attention.COMPILE if not f.startswith("-march")] + [f"-march={march}"]
    lib = cpu_attention.build_prefill_kernel(flags)
    if lib is None:
        pytest.skip(f"cannot build for {march} here (the log says why)")
    # without FMA (x86-64's baseline) the engine keeps SDPA: slower there
    assert lib.paged_prefill_lanes() == (8 if march == "haswell" else 0)
    backend = cpu_attention.PagedCPUBackend()
    backend.prefill_lib = lib
    step = scattered_step(WHOLE_PROMPTS + CHUNKS, 8, 2, 64, 16)
    assert_equals_reference(backend, step, 0.125)
    assert_equals_reference(backend, step, 0.125, window=50)
    groups_of_16 = scattered_step(CHUNKS, 16, 1, 32, 16)  # G = 16: one position a 16-row tile
    assert_equals_reference(backend, groups_of_16, 32**-0.5)


def test_the_engine_loads_the_kernel_where_this_cpu_has_fma() -> None:
    lib = cpu_attention.load_prefill_kernel()
    has_fma = (
        " fma" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else None
    )
    if has_fma is None:
        pytest.skip("no /proc/cpuinfo to read the CPU's features from")
    assert (lib is not None) == has_fma
    if lib is not None:
        assert lib.paged_prefill_lanes() in (8, 16)


def test_head_dims_the_kernel_does_not_take_go_to_sdpa(sdpa_prefills: list[int]) -> None:
    """A head dim that is not a multiple of 4: SDPA attends the chunks, with the same answer."""
    step = scattered_step(CHUNKS, 4, 2, 18, 8)
    assert_equals_reference(cpu_attention.PagedCPUBackend(), step, 0.25)
    assert sdpa_prefills == [len(CHUNKS)]
    sdpa_prefills.clear()


@needs_prefill_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 50])
def test_int8_prefill_kernel_equals_the_reference_on_the_same_codes(
    dtype: torch.dtype, window: int | None
) -> None:
    """The kernel decodes each chunk's codes with their scales; the reference dequantizes the
    same codes (and keys stored smoothed are read by queries multiplied by the smoothing)."""
    q, k, v, meta = scattered_step(WHOLE_PROMPTS + CHUNKS, 8, 4, 64, 16, dtype, (9, 40))
    smoothing = torch.ones(64)
    smoothing[[3, 35]] = 8.0  # a rotary pair stored divided by 8
    k8 = dataclasses.replace(as_int8(k.float() / smoothing, dtype), smoothing=smoothing)
    v8 = as_int8(v.float(), dtype)
    int8_meta = AttentionMetadata(
        [(k8, v8)], meta.slot_mapping, meta.prefills, meta.decodes, meta.backend
    )
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert_equals_reference(
        cpu_attention.PagedCPUBackend(), (q, k8, v8, int8_meta), 0.125, window, tolerance
    )
    rows = computed_rows(meta)
    on_float = ReferenceBackend().attend(q, k, v, meta, 0.125, window)[rows]
    on_codes = ReferenceBackend().attend(q, k8, v8, int8_meta, 0.125, window)[rows]
    assert not torch.equal(on_float, on_codes)  # the codes are read, not a float copy

"""The one-call-per-kind backends (`flex` in both KV layouts, `padded-sdpa`) against the
reference backend within float32 rounding, on steps built as the engine builds them: decodes,
prefills, both mixed, chunked prefill, prefix hits, sliding windows, an int8 cache, GQA; the
flex block lists against the mask they stand for; and no host sync on the decode path."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from serve.model import flex_attention
from serve.model.attention import AttentionBackend
from serve.model.flex_attention import FlexAttentionBackend
from serve.model.padded_attention import PaddedSDPABackend
from serve.model.query_batches import step_batches
from tests.serve.attention_steps import Shape, Step, make_step

BACKENDS = {
    "flex-paged": lambda: FlexAttentionBackend("paged"),
    "flex-gathered": lambda: FlexAttentionBackend("gathered"),
    "padded-sdpa": PaddedSDPABackend,
}
STEPS = {
    "decode-only": [(0, 1), (6, 1), (15, 1), (16, 1), (40, 1), (99, 1)],
    "prefill-only": [(0, 5), (0, 33), (0, 16)],
    "mixed": [(20, 1), (47, 1), (0, 30), (0, 7)],
    "mixed-interleaved": [(0, 30), (20, 1), (0, 7), (47, 1)],
    "one-token-contexts": [(0, 1), (0, 1), (0, 2)],
    "chunked-prefill": [(16, 20), (37, 11), (3, 40), (63, 1)],
}
SHAPES = {
    "gqa": Shape(heads=8, kv_heads=2),
    "mha": Shape(heads=4, kv_heads=4),
    "mqa": Shape(heads=4, kv_heads=1, head_dim=32, block_size=8),
    "gqa-of-3": Shape(heads=6, kv_heads=2),
}
"""Query heads per KV head 4, 1, 4 (folded into the query rows of a KV head) and 3 (not: it
does not divide a query block)."""


def assert_matches_reference(step: Step, backend: AttentionBackend, window: int | None) -> None:
    expected = step.reference(window)
    torch.testing.assert_close(step.attend(backend, window), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("shape", SHAPES)
def test_equals_the_reference(backend: str, steps: str, shape: str) -> None:
    impl = BACKENDS[backend]()
    step = make_step(STEPS[steps], SHAPES[shape], impl)
    assert_matches_reference(step, impl, None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 7, 16, 1000])
@pytest.mark.parametrize("steps", ["mixed", "chunked-prefill"])
def test_sliding_window_equals_the_reference(backend: str, window: int, steps: str) -> None:
    """Windows of 1, under a block, of a block (Gemma 3's test models: 16) and past every
    context, over chunks that start inside, at and past the window."""
    impl = BACKENDS[backend]()
    step = make_step(STEPS[steps], Shape(), impl)
    assert_matches_reference(step, impl, window)
    if window < 40:
        assert not torch.allclose(step.reference(), step.reference(window))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_hit_shared_blocks_equal_the_reference(backend: str) -> None:
    """Three sequences start on the same two physical blocks (a prefix-cache hit): decoding,
    prefilling after the hit, and the one that wrote them."""
    impl = BACKENDS[backend]()
    step = make_step([(40, 8), (32, 1), (45, 20)], Shape(), impl, shared_blocks=2)
    tables = [t for b in step_batches(step.meta) if b is not None for t in b.block_tables]
    assert len({int(t[0]) for t in tables}) == 1
    assert_matches_reference(step, impl, None)
    assert_matches_reference(step, impl, 16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 16])
def test_int8_kv_cache_equals_the_reference(backend: str, window: int | None) -> None:
    """Codes and scales as the cache stores them, keys divided by a power-of-two smoothing."""
    impl = BACKENDS[backend]()
    step = make_step(STEPS["chunked-prefill"], Shape(kv_cache_dtype="int8"), impl)
    assert_matches_reference(step, impl, window)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layout", ["paged", "gathered"])
@pytest.mark.parametrize("window", [None, 5, 16, 40])
def test_block_lists_are_exactly_the_blocks_with_a_visible_key(
    layout: str, window: int | None, group: int
) -> None:
    """On CUDA the kernel reads only the listed blocks (eagerly, flex scores every key): every
    block holding a key some query of a query block sees is listed, and no other."""
    backend = FlexAttentionBackend(layout)  # type: ignore[arg-type]
    step = make_step(STEPS["chunked-prefill"], Shape(block_size=8), backend)
    fb = backend.batches(step.meta, step.k_cache)[-1]  # the prefill chunks
    assert fb.batch.max_query_len == 40
    count, index = fb.kv_blocks(window, group)
    bs = fb.block_size
    num_keys = step.k_cache.shape[0] * bs if layout == "paged" else index.shape[-1] * bs
    b, q, kv = torch.meshgrid(
        torch.arange(fb.batch.size),
        torch.arange(fb.q_len(group)),
        torch.arange(num_keys),
        indexing="ij",
    )
    seen = fb.mask_mod(window, group)(b, torch.zeros_like(b), q, kv)
    for s in range(fb.batch.size):
        for qb in range(count.shape[-1]):
            rows = seen[s, qb * 16 : (qb + 1) * 16]
            wanted = {k // bs for k in rows.any(0).nonzero().flatten().tolist()}
            listed = set(index[s, 0, qb, : count[s, 0, qb]].tolist())
            assert listed == wanted, (s, qb)


class NoHostSync(TorchDispatchMode):
    """Fails on every op that reads a device value back to the host."""

    SYNCS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func._schema.name in self.SYNCS:
            raise AssertionError(f"host sync: {func._schema.name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_path_reads_nothing_back_to_the_host(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Everything but flex_attention's own kernel (on CUDA one compiled kernel; eagerly it
    compiles its higher-order op, which refuses to run under a dispatch mode)."""
    run_flex = flex_attention.run_flex

    def outside_the_mode(*args: Any) -> torch.Tensor:
        with _disable_current_modes():
            return run_flex(*args)

    monkeypatch.setattr(flex_attention, "run_flex", outside_the_mode)
    impl = BACKENDS[backend]()
    step = make_step(STEPS["decode-only"], Shape(), impl)
    with NoHostSync():
        got = step.attend(impl, 16)
    torch.testing.assert_close(got, step.reference(16), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_made_metadata_without_flat_tables_equals_the_reference(backend: str) -> None:
    """Metadata made by hand (benchmarks) may carry only the per-sequence structures."""
    impl = BACKENDS[backend]()
    step = make_step(STEPS["chunked-prefill"], Shape(), impl)
    bare = dataclasses.replace(step.meta, query_start_loc=None, block_tables=None)
    step = dataclasses.replace(step, meta=bare)
    assert_matches_reference(step, impl, 16)


def test_flex_batches_are_built_by_each_forwards_first_layer() -> None:
    """Later layers reuse the first layer's batches; the next forward over the same metadata
    (a decode graph's CPU stand-in replays it over refilled buffers) builds them again."""
    backend = FlexAttentionBackend("paged")
    step = make_step(STEPS["mixed"], Shape(), backend)
    second_layer = (step.k_cache.clone(), step.v_cache.clone())
    meta = dataclasses.replace(step.meta, kv_caches=[*step.meta.kv_caches, second_layer])
    first = backend.batches(meta, step.k_cache)
    assert [b.batch.max_query_len for b in first] == [1, 30]
    assert backend.batches(meta, second_layer[0]) is first
    assert backend.batches(meta, step.k_cache) is not first


@pytest.mark.parametrize(
    ("name", "device", "block_size", "head_dim", "chosen"),
    [
        ("auto", "cuda", 16, 64, FlexAttentionBackend),
        ("auto", "cuda", 32, 256, FlexAttentionBackend),
        ("auto", "cuda", 8, 64, PaddedSDPABackend),
        ("auto", "cuda", 16, 80, PaddedSDPABackend),
        ("padded-sdpa", "cuda", 16, 64, PaddedSDPABackend),
        ("flex", "cpu", 5, 80, FlexAttentionBackend),
        ("padded-sdpa", "cpu", 16, 64, PaddedSDPABackend),
        ("auto", "cpu", 16, 64, type(None)),
        ("sdpa", "cuda", 16, 64, type(None)),
    ],
)
def test_auto_picks_flex_on_cuda_where_the_shapes_fit_else_padded_sdpa(
    name: str, device: str, block_size: int, head_dim: int, chosen: type
) -> None:
    """None: the name is another backend's (on the CPU, auto stays paged-cpu or sdpa)."""
    got = flex_attention.cuda_backend(name, torch.device(device), block_size, head_dim)
    assert type(got) is chosen


def test_flex_that_cannot_run_is_refused_naming_why_and_the_fallback() -> None:
    with pytest.raises(ValueError, match=r"block size 8 is not a power of two.*padded-sdpa"):
        flex_attention.cuda_backend("flex", torch.device("cuda"), 8, 64)


@pytest.mark.parametrize("backend", ["flex", "padded-sdpa"])
def test_the_engine_builds_the_named_backend(backend: str, tiny_model_dir: Path) -> None:
    from serve.core.config import CacheConfig, ModelConfig
    from serve.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        ModelConfig(str(tiny_model_dir), dtype="float32", device="cpu", attention_backend=backend),  # type: ignore[arg-type]
        CacheConfig(block_size=16, num_blocks=16),
    )
    assert (
        type(engine.runner.backend)
        is {"flex": FlexAttentionBackend, "padded-sdpa": PaddedSDPABackend}[backend]
    )


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)")
CUDA_BACKENDS = {"flex": FlexAttentionBackend, "padded-sdpa": PaddedSDPABackend}
"""On CUDA flex reads the cache in place (`paged`) through compiled Triton kernels."""


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("steps", STEPS)
def test_on_cuda_equals_the_reference(backend: str, window: int | None, steps: str) -> None:
    """float32 (TF32 off): within float32 rounding of the reference, summed in another order."""
    impl = CUDA_BACKENDS[backend]()
    step = make_step(STEPS[steps], Shape(heads=8, kv_heads=2, head_dim=64), impl, device="cuda")
    expected = step.reference(window)
    torch.testing.assert_close(step.attend(impl, window), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_bfloat16_and_int8_on_cuda_equal_the_reference(backend: str, kv_cache_dtype: str) -> None:
    """bf16 in, float32 accumulation: within bf16's precision of the reference computed in
    float32 from the same inputs (an int8 cache: from the same codes and scales)."""
    impl = CUDA_BACKENDS[backend]()
    shape = Shape(heads=8, kv_heads=2, head_dim=64, kv_cache_dtype=kv_cache_dtype)
    shape = dataclasses.replace(shape, dtype=torch.bfloat16)
    step = make_step(STEPS["chunked-prefill"], shape, impl, device="cuda", shared_blocks=1)
    got = step.attend(impl, 16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), step.reference(16).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", CUDA_BACKENDS)
def test_decode_attention_replays_in_a_cuda_graph_over_new_contents(backend: str) -> None:
    """Captured once (after a warm-up that compiles), replayed after the cache's contents and
    the sequences' lengths changed in place: the reference's answer for the new values."""
    impl = CUDA_BACKENDS[backend]()
    step = make_step(
        STEPS["decode-only"], Shape(heads=8, kv_heads=2, head_dim=64), impl, device="cuda"
    )
    step.attend(impl, 16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step.attend(impl, 16)
    assert isinstance(step.k_cache, torch.Tensor) and step.meta.seq_lens is not None
    step.k_cache.normal_()
    step.meta.seq_lens.sub_(torch.tensor([0, 1, 1, 1, 2, 3], device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, step.reference(16), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compiled_flex_traces_the_mask_whole_and_equals_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What CUDA runs, compiled here by inductor's CPU backend (static shapes: 20-30 s a shape
    on two cores): the mask function traces into one graph (fullgraph) and gives the reference's
    answer, on two steps of the same shapes with different contents (no recompile between)."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention as flex

    compiled = torch.compile(flex, fullgraph=True, dynamic=False)
    monkeypatch.setattr(flex_attention, "_flex", lambda device: compiled)
    backend = FlexAttentionBackend("gathered")
    graphs = []
    for seed in (0, 1):
        step = make_step([(20, 1), (47, 1), (0, 30), (3, 30)], Shape(), backend, seed=seed)
        assert_matches_reference(step, backend, 16)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]

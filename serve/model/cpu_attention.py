"""Paged attention on the CPU through two small C kernels (`kernels/paged_decode.c`,
`kernels/paged_prefill.c`).

Model: decoding sequences read their keys and values from the KV blocks where they sit, every
cached byte once per layer: one sequence per work item when there are at least four a thread
(each cached token's K (then V) row of every KV head read front to back: 1.28x the pair items'
bandwidth at 64 sequences), else one (sequence, KV head) pair; no per-layer gather of each
sequence's blocks and no padding to the longest sequence (the SDPA backend does both).
Float32 and bfloat16 models, their caches in the model's dtype or in int8 with a scale per
(token, KV head) (`serve/model/kv_cache.py`, read in place: codes and scales); scores, softmax and
sums in float32.
Prefill chunks: every chunk of the step in one call, flash-attention style over each chunk's
blocks in place, key blocks past a query tile's last position never read (SDPA's CPU kernel
computes about three quarters of the full square at 1,024 tokens and gathers each sequence's
blocks first); a tile's (position, query head) rows sit across SIMD lanes, so both products
broadcast a key's (value's) scalar against row vectors. Caches as the decode kernel's (an int8
chunk's keys and values decoded into float rows first). Used where the CPU has FMA (x86 with AVX2
or AVX-512): built without it, the kernel measured 1.5-4x slower than SDPA, which then stays.

The library is built by `serve/model/native.py` with `-O3 -ffast-math`; where no compiler
works, `load_kernel` returns None and the engine keeps SDPA.
NOTE: results equal SDPA's up to float32 rounding (about 1e-6 relative); the engine tests stay
token-exact against `generate`.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from typing import Any

import torch

from serve.model.attention import AttentionMetadata, DecodeGroup
from serve.model.kv_cache import Int8KV, KVTensor
from serve.model.native import KERNELS, NEEDS_COMPILER, load_library
from serve.model.sdpa_attention import SDPABackend

log = logging.getLogger(__name__)

SOURCE = KERNELS / "paged_decode.c"
COMPILE = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
"""NOTE: -ffast-math (vectorized dot products and expf) only when compiling: linked with it, the
library would bring crtfastmath, which flushes denormals to zero for the whole process."""
_FUNCTIONS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
_INT8_FUNCTIONS = {torch.float32: "paged_decode_i8_f32", torch.bfloat16: "paged_decode_i8_bf16"}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _I, ctypes.c_int]
_INT8_ARGTYPES = [*_ARGTYPES[:3], _P, _P, *_ARGTYPES[3:]]
"""The int8 functions take the K and V scales after the caches."""


PREFILL_SOURCE = KERNELS / "paged_prefill.c"
_PREFILL_FUNCTIONS = {torch.float32: "paged_prefill_f32", torch.bfloat16: "paged_prefill_bf16"}
_PREFILL_INT8_FUNCTIONS = {
    torch.float32: "paged_prefill_i8_f32",
    torch.bfloat16: "paged_prefill_i8_bf16",
}
_PREFILL_ARGTYPES = [_P, _P, _P, _P, _P, _P, _P, _I, _P, *_ARGTYPES[7:]]
"""q, k, v, starts, query_lens, seq_lens, block_tables, table_width, out, then as the decode
kernel's: count, heads, KV heads, head dim, block size, scale, window, threads."""
_PREFILL_INT8_ARGTYPES = [*_PREFILL_ARGTYPES[:3], _P, _P, *_PREFILL_ARGTYPES[3:]]


def build_prefill_kernel(flags: list[str]) -> ctypes.CDLL | None:
    """The prefill kernel compiled with `flags` (built once per flags and CPU), its functions'
    signatures declared; None (logged) where it cannot be built."""
    signatures: dict[str, list[Any]] = {"paged_prefill_lanes": []}
    signatures |= {name: _PREFILL_ARGTYPES for name in _PREFILL_FUNCTIONS.values()}
    signatures |= {name: _PREFILL_INT8_ARGTYPES for name in _PREFILL_INT8_FUNCTIONS.values()}
    return load_library(PREFILL_SOURCE, flags, signatures, "paged CPU prefill unavailable")


@cache
def load_prefill_kernel() -> ctypes.CDLL | None:
    """The prefill kernel's library for this CPU, built on first use; None (logged once) where it
    cannot be built or is slower than SDPA (a CPU without FMA: `paged_prefill_lanes`, measured on
    x86): prefill chunks then stay on SDPA."""
    lib = build_prefill_kernel(COMPILE)
    if lib is not None and lib.paged_prefill_lanes() == 0:
        log.warning("paged CPU prefill off: this CPU has no FMA, where SDPA is faster")
        return None
    return lib


@cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None (and one log line saying
    why) when it cannot be built here."""
    signatures = {name: _ARGTYPES for name in _FUNCTIONS.values()}
    signatures |= {name: _INT8_ARGTYPES for name in _INT8_FUNCTIONS.values()}
    return load_library(SOURCE, COMPILE, signatures, "paged CPU attention unavailable")


def _kernel_operands(
    q: torch.Tensor,
    k_cache: KVTensor,
    v_cache: KVTensor,
    functions: dict[torch.dtype, str],
    int8_functions: dict[torch.dtype, str],
) -> tuple[torch.Tensor, str | None, list[torch.Tensor]]:
    """The queries a kernel reads (multiplied by an int8 key cache's smoothing: its keys are
    stored divided by it, so q . k is unchanged), the kernel function for this cache, and the
    cache tensors it takes after them (K and V; int8: codes, then scales). No function: a cache
    the kernels do not read (another dtype than the queries', or K and V of different kinds)."""
    if isinstance(k_cache, Int8KV) and isinstance(v_cache, Int8KV):
        if k_cache.smoothing is not None:
            q = q * k_cache.smoothing.to(q.dtype)
        caches = [k_cache.data, v_cache.data, k_cache.scales, v_cache.scales]
        return q, int8_functions.get(q.dtype), caches
    if (
        isinstance(k_cache, torch.Tensor)
        and isinstance(v_cache, torch.Tensor)
        and k_cache.dtype == v_cache.dtype == q.dtype
    ):
        return q, functions.get(q.dtype), [k_cache, v_cache]
    return q, None, []


MAX_GROUP, MAX_HEAD_DIM = 16, 512
"""The kernels' limits: query heads per KV head, and head dim (the prefill kernel's: a multiple
of 4 too)."""


def _launch(
    function: Any,
    pointers: list[int],
    count: int,
    q: torch.Tensor,
    k_cache: KVTensor,
    scale: float,
    window: int | None,
    kernel: str,
) -> None:
    """Call a kernel: its own leading arguments (data pointers, a table's width), then the tail
    both kernels share: sequences (chunks), heads, KV heads, head dim, block size, scale, window
    (0: none), threads. A failure (shapes past the limits, no scratch memory) raises."""
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    threads = torch.get_num_threads()
    shapes = (heads, kv_heads, head_dim, block_size)
    rc = function(*pointers, count, *shapes, scale, window or 0, threads)
    if rc != 0:
        raise RuntimeError(
            f"paged {kernel} kernel failed (code {rc}): heads {heads}, kv heads {kv_heads}, head "
            f"dim {head_dim} (at most {MAX_GROUP} query heads per KV head, head dim <= "
            f"{MAX_HEAD_DIM}; code 2: no memory for its scratch)"
        )


def unsupported_reason(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> str | None:
    """Why the kernel cannot run this model's attention here (None: it can; the first call
    builds it)."""
    if device.type != "cpu" or dtype not in _FUNCTIONS:
        return f"it runs on the CPU in float32 or bfloat16 (here: {device}, {dtype})"
    if heads % kv_heads or heads // kv_heads > MAX_GROUP or head_dim > MAX_HEAD_DIM:
        return (
            f"it takes at most {MAX_GROUP} query heads per KV head and head dim <= "
            f"{MAX_HEAD_DIM} (here: {heads} heads, {kv_heads} KV heads, head dim {head_dim})"
        )
    if load_kernel() is None:
        return NEEDS_COMPILER
    return None


class PagedCPUBackend(SDPABackend):
    decode_group_size: int | None = None
    static_decodes = True

    def __init__(self) -> None:
        lib = load_kernel()
        if lib is None:
            raise ValueError(
                f"the paged-cpu attention backend cannot run here: {NEEDS_COMPILER}; install "
                "one, or use --attention-backend sdpa"
            )
        self.lib = lib
        self.prefill_lib = load_prefill_kernel()

    def attend(
        self,
        q: torch.Tensor,
        k_cache: KVTensor,
        v_cache: KVTensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """As `SDPABackend.attend`, over contiguous [T, H, D] rows (what both kernels read; the
        output is then contiguous too)."""
        return super().attend(q.contiguous(), k_cache, v_cache, meta, scale, window)

    def attend_prefills(  # type: ignore[override]  # SDPABackend's is a staticmethod
        self,
        q: torch.Tensor,
        k_cache: KVTensor,
        v_cache: KVTensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        window: int | None = None,
    ) -> None:
        """Every prefill chunk of the step in one kernel call, writing their rows of `out`;
        through SDPA where the kernel cannot take them (a head dim not a multiple of 4, no
        kernel)."""
        if not meta.prefills:
            return
        kernel_q, name, caches = q, None, list[torch.Tensor]()
        if self.prefill_lib is not None and q.shape[-1] % 4 == 0:
            kernel_q, name, caches = _kernel_operands(
                q, k_cache, v_cache, _PREFILL_FUNCTIONS, _PREFILL_INT8_FUNCTIONS
            )
        if name is None or not (kernel_q.is_contiguous() and out.is_contiguous()):
            SDPABackend.attend_prefills(q, k_cache, v_cache, meta, scale, out, window)
            return
        table = meta.prefill_table
        assert all(c.is_contiguous() for c in caches)
        pointers = [kernel_q.data_ptr(), *[c.data_ptr() for c in caches]]
        pointers += [t.data_ptr() for t in (table.starts, table.query_lens, table.seq_lens)]
        pointers += [table.block_tables.data_ptr(), table.block_tables.shape[1], out.data_ptr()]
        function = getattr(self.prefill_lib, name)
        _launch(function, pointers, len(meta.prefills), q, k_cache, scale, window, "prefill")

    def attend_decodes(
        self,
        q: torch.Tensor,
        k_cache: KVTensor,
        v_cache: KVTensor,
        group: DecodeGroup,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """One decode group through the kernel: q [S_g, heads, head_dim] (a token per
        sequence) -> the same shape."""
        q, name, caches = _kernel_operands(q, k_cache, v_cache, _FUNCTIONS, _INT8_FUNCTIONS)
        if q.device.type != "cpu" or name is None:
            raise ValueError(
                "paged-cpu attention takes CPU float32/bfloat16 queries over a cache of their "
                f"dtype or int8, got {q.dtype} queries"
            )
        q = q.contiguous()
        out = torch.empty_like(q)
        tables = group.block_tables.contiguous()
        lens = group.seq_lens.contiguous()
        assert tables.dtype == lens.dtype == torch.int64
        assert all(c.is_contiguous() for c in caches)
        pointers = [q.data_ptr(), *[c.data_ptr() for c in caches], tables.data_ptr()]
        pointers += [tables.shape[1], lens.data_ptr(), out.data_ptr()]
        _launch(getattr(self.lib, name), pointers, len(q), q, k_cache, scale, window, "decode")
        return out

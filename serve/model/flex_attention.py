"""Paged attention through FlexAttention: one call a layer for every decode of the step, one for
every prefill chunk (`flex`).

Model: each batch of `serve/model/query_batches.py` is one `flex_attention` call over queries
`[B, heads, max_query_len, head_dim]` with a `BlockMask` built from the batch's block tables:
for every (sequence, query block of `Q_BLOCK` rows) the KV blocks its queries can see, from the
one holding the first key of the window (or the context) to the one holding the block's last
query; blocks past a query block, before its window, and padding rows are never read. The mask
function then decides each (query, key) pair with `visible`, so it alone is exact; the block
lists only save work.

Grouped-query attention: a KV head's query heads are folded into its query rows (row r of KV head
k is position r // g of query head k * g + r % g, for g query heads a KV head, where g divides
the query block), so each KV block is read once for all g heads, and decodes fill g rows of a
query block instead of one (flex decoding's packing; otherwise flex maps each head to its own).

Two layouts of the keys and values:
- `paged` (CUDA): the layer's cache itself, `[1, kv_heads, num_blocks * block_size, head_dim]`,
  read in place; the block lists name physical blocks. A key's position is its block's index in
  the sequence's table (`block_position`, scattered from the tables each step) times the block
  size plus its offset, and the key is the sequence's only if the table holds that block there.
  NOTE: this relies on a block having one table index in every table that holds it: prefix-cache
  blocks are keyed by a hash chaining every earlier block (`serve/core/block_pool.py`), so a
  shared block sits at the same index in every sequence; a private block is in one table.
- `gathered` (an int8 cache, and the CPU): each sequence's blocks gathered (an int8 cache
  dequantized) into `[B, kv_heads, W * block_size, head_dim]`; positions are offsets. Used where
  the cache is not in the queries' dtype, and on the CPU, where flex_attention runs eagerly (its
  unfused implementation scores every key of the layout: in place, the whole cache).

On CUDA `flex_attention` goes through `torch.compile` (Triton kernels, compiled once per shape
class: query lengths are rounded up to a power of two to bound them); on the CPU it runs eagerly
(the CPU default stays the C kernels of `paged-cpu`: compiling flex for the CPU takes 20-30 s a
shape here).
NOTE: no host sync and no data-dependent shape on either path; shapes follow from (B,
max_query_len, W, num_blocks), so the decode call can be captured in a CUDA graph once compiled.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import torch

from serve.model.attention import AttentionBackend, AttentionMetadata
from serve.model.kv_cache import Int8KV, KVTensor
from serve.model.padded_attention import PaddedSDPABackend
from serve.model.query_batches import PerForward, QueryBatch, step_batches, visible
from serve.model.sdpa_attention import gather_batch

Layout = Literal["paged", "gathered"]
Q_BLOCK = 16
"""Query rows per block of the mask (and the kernel's BLOCK_M on CUDA)."""
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def unsupported_reason(device: torch.device, block_size: int, head_dim: int) -> str | None:
    """Why the flex backend cannot run here (None: it can): on CUDA the kernel's key block is
    the cache block, so both it and the head dim must be powers of two of at least 16."""
    if not flex_available():
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention"
    if device.type != "cuda":
        return None
    if not _NO_Q_BLOCKS:
        return f"torch {torch.__version__}'s BlockMask cannot skip its query-block lists"

    def fits(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    if not fits(block_size):
        return f"block size {block_size} is not a power of two >= 16 (FlexAttention's KV block)"
    if not fits(head_dim):
        return f"head dim {head_dim} is not a power of two >= 16"
    return None


def cuda_backend(
    name: str, device: torch.device, block_size: int, head_dim: int
) -> AttentionBackend | None:
    """The backend `flex` and `padded-sdpa` name, and auto's choice on CUDA (flex where it
    runs, else padded-sdpa); None for another name, or auto on the CPU (`paged-cpu`'s turn).
    An explicit `flex` that cannot run is refused with the reason."""
    why_not = unsupported_reason(device, block_size, head_dim)
    if name == "flex" and why_not:
        raise ValueError(
            f"the flex attention backend cannot run here: {why_not}; "
            "use --attention-backend padded-sdpa"
        )
    if name == "flex" or (name == "auto" and device.type == "cuda" and not why_not):
        return FlexAttentionBackend()
    if name == "padded-sdpa" or (name == "auto" and device.type == "cuda"):
        return PaddedSDPABackend()
    return None


def _triton_kernel() -> dict[str, Any]:
    """The option forcing the general Triton kernel (not flex decoding, whose blocks differ):
    `BACKEND` where torch has it, else the older `FORCE_USE_FLEX_ATTENTION`."""
    if not flex_available():
        return {}
    import torch.nn.attention.flex_attention as flex

    options = getattr(flex, "FlexKernelOptions", None)
    if options is not None and "BACKEND" in options.__annotations__:
        return {"BACKEND": "TRITON"}
    return {"FORCE_USE_FLEX_ATTENTION": True}


_TRITON_KERNEL = _triton_kernel()


def _no_q_blocks() -> dict[str, Any]:
    """Skip the transposed (query-block) lists, which only the backward pass reads: building
    them densifies the block lists to every block of the cache. Older torch always builds them."""
    if not flex_available():
        return {}
    from torch.nn.attention.flex_attention import BlockMask

    params = inspect.signature(BlockMask.from_kv_blocks).parameters
    return {"compute_q_blocks": False} if "compute_q_blocks" in params else {}


_NO_Q_BLOCKS = _no_q_blocks()


@cache
def _compiled_flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, fullgraph=True)


def _flex(device: torch.device) -> Callable[..., Any]:
    if device.type == "cuda":
        return _compiled_flex()
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


@dataclass(frozen=True)
class FlexBatch:
    """One batch's block masks and what their mask functions read. `group`: query heads folded
    into the query rows of each KV head (row r is position r // group of query head
    kv_head * group + r % group), so a KV block is read once for the group's heads."""

    batch: QueryBatch
    layout: Layout
    block_size: int
    block_position: torch.Tensor | None
    """paged: [num_blocks + 1] each block's index in the table holding it (the last entry takes
    the padding's writes)."""

    def q_len(self, group: int) -> int:
        """The padded query rows: `max_query_len` x `group`, a power of two on CUDA."""
        return padded_query_len(self.batch.max_query_len * group, self.batch.starts.device)

    def mask_mod(self, window: int | None, group: int) -> MaskMod:
        """The exact mask on (sequence, query row, key index of the layout): the key is the
        sequence's, the row a real query, and `visible` holds. Closes over tensors and ints
        only (what compiled flex traces)."""
        context, query_lens = self.batch.context_lens, self.batch.query_lens
        seq_lens, tables, bs = self.batch.seq_lens, self.batch.block_tables, self.block_size
        position = self.block_position

        def mask(
            b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            offset = q_idx // group
            real, q_pos = offset < query_lens[b], context[b] + offset
            if position is None:  # gathered: the key index is its position
                return real & visible(q_pos, kv_idx, seq_lens[b], window)
            block = kv_idx // bs
            index = position[block].clamp(max=tables.shape[1] - 1)
            owned = tables[b, index] == block
            k_pos = index * bs + kv_idx % bs
            return real & owned & visible(q_pos, k_pos, seq_lens[b], window)

        return mask

    def kv_blocks(self, window: int | None, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, 1, q blocks] blocks each query block reads, [B, 1, q blocks, W] which: table
        entries (paged) or table indices (gathered), from the first the block can see)."""
        batch, bs = self.batch, self.block_size
        rows = torch.arange(0, self.q_len(group), Q_BLOCK, device=batch.starts.device)
        offsets = rows // group
        first_pos = batch.context_lens[:, None] + offsets[None, :]
        last_pos = torch.minimum(first_pos + Q_BLOCK // group, batch.seq_lens[:, None]) - 1
        if window is None:
            first_block = torch.zeros_like(first_pos)
        else:
            first_block = (first_pos - window + 1).clamp(min=0) // bs
        count = last_pos // bs - first_block + 1
        count = torch.where(offsets[None, :] < batch.query_lens[:, None], count, 0)
        width = batch.block_tables.shape[1]
        index = first_block[:, :, None] + torch.arange(width, device=rows.device)
        index = index.clamp_(max=width - 1)
        if self.layout == "paged":
            seqs = torch.arange(batch.size, device=rows.device)[:, None, None]
            index = batch.block_tables[seqs, index]
        return count[:, None].int(), index[:, None].int()

    def block_mask(self, window: int | None, num_keys: int, group: int) -> Any:
        from torch.nn.attention.flex_attention import BlockMask

        count, index = self.kv_blocks(window, group)
        return BlockMask.from_kv_blocks(
            count,
            index,
            BLOCK_SIZE=(Q_BLOCK, self.block_size),
            mask_mod=self.mask_mod(window, group),
            seq_lengths=(self.q_len(group), num_keys),
            **_NO_Q_BLOCKS,
        )

    def fold_queries(self, q: torch.Tensor, group: int) -> torch.Tensor:
        """q [T, heads, head_dim] -> [B, heads / group, q_len(group), head_dim]."""
        x = self.batch.gather_queries(q)  # [B, heads, L, D]
        b, heads, length, dim = x.shape
        x = x.view(b, heads // group, group, length, dim).transpose(2, 3)
        x = x.reshape(b, heads // group, length * group, dim)
        return torch.nn.functional.pad(x, (0, 0, 0, self.q_len(group) - length * group))

    def unfold_outputs(self, o: torch.Tensor, group: int) -> torch.Tensor:
        """`fold_queries`' inverse on the outputs: [B, heads, max_query_len, head_dim]."""
        b, kv_heads, _, dim = o.shape
        length = self.batch.max_query_len
        o = o[:, :, : length * group].view(b, kv_heads, length, group, dim).transpose(2, 3)
        return o.reshape(b, kv_heads * group, length, dim)


def query_group(heads: int, kv_heads: int) -> int:
    """Query heads folded into the rows of each KV head: the whole GQA group where it divides a
    query block, else none (flex's own GQA then maps each query head to its KV head)."""
    group = heads // kv_heads
    return group if Q_BLOCK % group == 0 else 1


def padded_query_len(n: int, device: torch.device) -> int:
    """`n` rounded up: to a power of two on CUDA (a bounded set of compiled shapes)."""
    return 1 << (n - 1).bit_length() if device.type == "cuda" else n


def scatter_block_positions(position: torch.Tensor, batch: QueryBatch, block_size: int) -> None:
    """position[block] = its index in the table that holds it, for every block of the batch's
    contexts; table padding writes into the spare last entry."""
    tables = batch.block_tables
    index = torch.arange(tables.shape[1], device=tables.device)[None, :].expand_as(tables)
    used = index < (batch.seq_lens[:, None] + block_size - 1) // block_size
    spare = torch.full_like(tables, position.shape[0] - 1)
    position.index_put_((torch.where(used, tables, spare),), index)


@dataclass(frozen=True)
class FlexStep:
    """One forward's flex batches and the block masks its layers made (by batch and window)."""

    batches: list[FlexBatch]
    masks: dict[tuple[int, int | None, int], Any]

    def block_mask(self, i: int, window: int | None, num_keys: int, group: int) -> Any:
        mask = self.masks.get((i, window, group))
        if mask is None:
            mask = self.batches[i].block_mask(window, num_keys, group)
            self.masks[i, window, group] = mask
        return mask


def cache_device(cache: KVTensor) -> torch.device:
    return cache.data.device if isinstance(cache, Int8KV) else cache.device


class FlexAttentionBackend:
    decode_group_size: int | None = None
    static_decodes = True

    def __init__(self, layout: Layout | None = None) -> None:
        self.layout = layout
        """None: `paged` on CUDA for a cache in the model's dtype, else `gathered`."""
        self._position: torch.Tensor | None = None
        self._step = PerForward(self.build_step)

    def layout_for(self, k_cache: KVTensor) -> Layout:
        if isinstance(k_cache, Int8KV):
            return "gathered"
        return self.layout or ("paged" if k_cache.device.type == "cuda" else "gathered")

    def block_position(self, k_cache: KVTensor) -> torch.Tensor:
        """The persistent [num_blocks + 1] block -> table index map (allocated on first use)."""
        n = k_cache.shape[0] + 1
        if self._position is None or self._position.shape[0] != n:
            self._position = torch.zeros(n, dtype=torch.long, device=cache_device(k_cache))
        return self._position

    def build_step(self, meta: AttentionMetadata) -> FlexStep:
        k_cache = meta.kv_caches[0][0]
        layout, bs = self.layout_for(k_cache), k_cache.shape[1]
        position = self.block_position(k_cache) if layout == "paged" else None
        made = []
        for batch in step_batches(meta):
            if batch is None:
                continue
            if position is not None:
                scatter_block_positions(position, batch, bs)
            made.append(FlexBatch(batch, layout, bs, position))
        return FlexStep(made, {})

    def batches(self, meta: AttentionMetadata, k_cache: KVTensor) -> list[FlexBatch]:
        """This forward's flex batches (built by its first layer)."""
        return self._step.get(meta, k_cache).batches

    def attend(
        self,
        q: torch.Tensor,
        k_cache: KVTensor,
        v_cache: KVTensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        out = q.new_empty(q.shape[0] + 1, *q.shape[1:])
        step = self._step.get(meta, k_cache)
        group = query_group(q.shape[1], k_cache.shape[2])
        for i, fb in enumerate(step.batches):
            k, v = self.keys_and_values(k_cache, v_cache, fb)
            mask = step.block_mask(i, window, k.shape[2], group)
            o = run_flex(fb.fold_queries(q, group), k, v, mask, scale, fb.block_size)
            fb.batch.scatter_outputs(out, fb.unfold_outputs(o, group))
        return out[:-1]

    @staticmethod
    def keys_and_values(
        k_cache: KVTensor, v_cache: KVTensor, fb: FlexBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[1 or B, kv_heads, keys, head_dim] K and V in the batch's layout."""
        if fb.layout == "gathered":
            tables = fb.batch.block_tables
            return gather_batch(k_cache, tables), gather_batch(v_cache, tables)
        assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
        flat = (1, -1, *k_cache.shape[2:])
        return k_cache.view(flat).transpose(1, 2), v_cache.view(flat).transpose(1, 2)


def run_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: float, block_size: int
) -> torch.Tensor:
    """flex_attention over the block mask; on CUDA with the kernel's blocks set to the mask's
    (BLOCK_N the cache block: the kernel never straddles two KV blocks)."""
    if q.device.type == "cuda":
        options = {**_TRITON_KERNEL, "BLOCK_M": Q_BLOCK, "BLOCK_N": block_size}
        return _flex(q.device)(
            q, k, v, block_mask=mask, scale=scale, enable_gqa=True, kernel_options=options
        )
    with warnings.catch_warnings():  # eager on the CPU by choice (see the module's model)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _flex(q.device)(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)

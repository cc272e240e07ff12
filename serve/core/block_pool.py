"""The KV block pool: fixed-size blocks, reference counts, an eviction-ordered free queue, and a
hash -> block map for prefix caching.

Model: every block is either *in use* (ref_cnt > 0, owned by one or more requests) or *free*
(ref_cnt == 0, in the free queue). A free block may still hold valid KV for a cached prefix: it
keeps its hash until it is handed out again, so a later request with the same prefix can take it
back (`touch`) instead of recomputing. `allocate` takes blocks from the head of the free queue
(least recently freed first) and drops their stale hashes; `free` appends to the tail.
Block 0 is the null block (`NULL_BLOCK_ID`, as in vLLM): it is never handed out, so padded
block-table entries and the slots of padded rows can point at it without touching any
request's KV; a pool of `num_blocks` hands out ids 1 .. num_blocks.
Pure Python over ints: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

BlockHash = bytes
"""A full block's prefix-cache key (`kv_cache_manager.block_key`: a sha256 digest)."""
NULL_BLOCK_ID = 0
"""The reserved block: padding points here; the KV tensors hold it before the pool's blocks."""


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    """Set once the block is full and registered for prefix caching."""
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append, and remove anywhere."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self.head.next_free
        assert first is not None and first is not self.tail, "no free block"
        self.remove(first)
        return first

    def block_ids(self) -> list[int]:
        out, node = [], self.head.next_free
        while node is not None and node is not self.tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        """`num_blocks` blocks to hand out (ids 1 .. num_blocks; the null block 0 is apart)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.null_block = KVBlock(NULL_BLOCK_ID)
        self.blocks = [KVBlock(i) for i in range(NULL_BLOCK_ID + 1, num_blocks + 1)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_blocks(self) -> int:
        """Blocks that can be handed out (the null block not counted)."""
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_prefix_caching else None

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the head of the free queue; the caller owns one reference each."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit), reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each, in the given order; unreferenced blocks join the queue tail."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash; the first block registered for a hash wins."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def check_integrity(self) -> None:
        """free + used == total; free blocks unreferenced; cache entries point at their hash;
        the null block never handed out."""
        free_ids = self.free_queue.block_ids()
        assert self.null_block.ref_cnt == 0 and NULL_BLOCK_ID not in free_ids
        assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks
        used = [b for b in self.blocks if b.ref_cnt > 0]
        assert len(free_ids) + len(used) == self.num_blocks
        assert all(self.blocks[i - 1].ref_cnt == 0 for i in free_ids)
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, (
                f"block {block.block_id} cached under a stale hash"
            )

"""Block pool and KV cache manager: exact block ids, eviction order, prefix caching."""

from __future__ import annotations

import pytest

from serve.core.block_pool import BlockPool
from serve.core.kv_cache_manager import KVCacheManager
from serve.core.request import Request
from serve.core.sampling_params import SamplingParams


def ids(blocks: list) -> list[int]:
    return [b.block_id for b in blocks]


def request(rid: str, tokens: list[int], adapter: int | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), adapter_id=adapter)


def test_allocate_takes_from_the_head_and_free_appends_to_the_tail() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert ids(a) == [1, 2] and ids(b) == [3, 4, 5]  # block 0 is the null block
    assert pool.free_queue.block_ids() == [6]
    pool.free(reversed(b))
    assert pool.free_queue.block_ids() == [6, 5, 4, 3]
    assert ids(pool.allocate(2)) == [6, 5]
    pool.check_integrity()


def test_shared_block_is_freed_only_by_its_last_owner() -> None:
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert block.ref_cnt == 1 and 1 not in pool.free_queue.block_ids()
    pool.free([block])
    assert pool.free_queue.block_ids() == [2, 3, 4, 1]
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([block])


def test_reallocating_a_cached_block_drops_its_hash() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"k" * 32)
    pool.free([block])
    assert pool.get_cached_block(b"k" * 32) is block  # free but still cached
    pool.allocate(2)  # evicts block 2 first, then block 1
    assert pool.get_cached_block(b"k" * 32) is None and block.block_hash is None
    pool.check_integrity()


def test_manager_allocates_lazily_and_registers_full_blocks() -> None:
    kv = KVCacheManager(BlockPool(10), block_size=4)
    r = request("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert kv.block_ids("a") == [1, 2, 3]
    kv.cache_full_blocks(r, 10)
    assert len(kv.pool.cached) == 2  # tokens 0-3 and 4-7; the third block is partial
    r.num_computed_tokens = 10
    r.append_output(99)
    assert kv.allocate_slots(r, 1) and kv.block_ids("a") == [1, 2, 3]
    r.num_computed_tokens = 11
    r.append_output(98)
    r.append_output(97)  # pretend decode of two more: 13 tokens need a 4th block
    assert kv.allocate_slots(r, 2) and kv.block_ids("a") == [1, 2, 3, 4]


def test_prefix_hit_shares_blocks_and_stops_before_the_last_token() -> None:
    kv = KVCacheManager(BlockPool(10), block_size=4)
    a = request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    kv.cache_full_blocks(a, 12)
    b = request("b", list(range(12)))  # identical: 3 full blocks, but the last token must run
    hits = kv.get_computed_blocks(b)
    assert ids(hits) == [1, 2]
    assert kv.allocate_slots(b, 4, hits)
    assert kv.block_ids("b") == [1, 2, 4]
    assert [kv.pool.blocks[i - 1].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    c = request("c", [*list(range(8)), 50, 51, 52, 53, 54])  # diverges in block 2
    assert ids(kv.get_computed_blocks(c)) == [1, 2]
    assert (kv.prefix_queries, kv.prefix_hits) == (25, 16)


def test_prefix_hash_includes_the_adapter() -> None:
    kv = KVCacheManager(BlockPool(10), block_size=4)
    a = request("a", list(range(9)), adapter=1)
    kv.allocate_slots(a, 9)
    kv.cache_full_blocks(a, 9)
    assert kv.get_computed_blocks(request("b", list(range(9)), adapter=2)) == []
    assert ids(kv.get_computed_blocks(request("c", list(range(9)), adapter=1))) == [1, 2]


def test_prefix_hit_needs_equal_tokens_even_when_python_hashes_collide(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CVE-2025-25183's class: keys were Python's `hash` of (parent, tokens, adapter), and a hit
    never compares tokens. With every Python hash colliding, a different prompt must still miss;
    the key is the sha256 of the parent key, the token ids and the adapter."""
    import builtins
    import hashlib

    from serve.core import kv_cache_manager

    monkeypatch.setattr(builtins, "hash", lambda _: 0)
    kv = KVCacheManager(BlockPool(10), block_size=4)
    a = request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.cache_full_blocks(a, 9)
    assert kv.get_computed_blocks(request("b", [7, 7, 7, 7, 8, 8, 8, 8, 9])) == []
    assert ids(kv.get_computed_blocks(request("c", list(range(9))))) == [1, 2]
    first = hashlib.sha256(bytes(32) + (0).to_bytes(8, "little") + (1).to_bytes(8, "little"))
    first.update((2).to_bytes(8, "little") + (3).to_bytes(8, "little") + b"-")
    assert (
        a.block_hashes[0] == first.digest() == kv_cache_manager.block_key(None, [0, 1, 2, 3], None)
    )


def test_free_blocks_can_be_revived_by_a_hit() -> None:
    kv = KVCacheManager(BlockPool(4), block_size=4)
    a = request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.cache_full_blocks(a, 9)
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [4, 3, 2, 1]
    b = request("b", list(range(9)))
    hits = kv.get_computed_blocks(b)
    assert ids(hits) == [1, 2]
    # 4 free blocks, 2 of them revived: 1 more needed for token 8 -> fits
    assert kv.allocate_slots(b, 1, hits)
    assert kv.block_ids("b") == [1, 2, 4]
    assert kv.pool.free_queue.block_ids() == [3]
    kv.pool.check_integrity()


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(BlockPool(3), block_size=4)
    r = request("a", list(range(20)))
    assert not kv.allocate_slots(r, 20)
    assert kv.pool.num_free_blocks == 3 and kv.block_ids("a") == []

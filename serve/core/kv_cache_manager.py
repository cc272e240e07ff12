"""Per-request block tables over the block pool, with prefix caching.

Model: request r owns `blocks[r]`, enough blocks for its `num_computed_tokens` plus the tokens
scheduled this step. Block i of a request holds the KV of its tokens [i*B, (i+1)*B). Once a block
is full (its tokens are all computed by the end of the step that fills it) it is registered in the
pool under `block_key(parent key, its token ids, adapter id)`, so a later request whose tokens and
adapter agree up to that block takes it instead of recomputing. A hit trusts the key without
comparing tokens, so the key is a sha256 (vLLM's fix for CVE-2025-25183: Python's `hash` of
token tuples can be made to collide, serving one caller's KV to another's prompt).

NOTE: a prefix hit never covers a request's last token: the model must run on at least one token
to produce logits, so a hit is cut to whole blocks within `num_tokens - 1`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from serve.core.block_pool import BlockHash, BlockPool, KVBlock
from serve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_key(
    parent: BlockHash | None, token_ids: Sequence[int], adapter_id: int | None
) -> BlockHash:
    """sha256 of the parent block's key, the block's token ids (int64) and the adapter id."""
    digest = hashlib.sha256(parent or bytes(32))
    digest.update(array("q", token_ids).tobytes())
    digest.update(b"-" if adapter_id is None else str(adapter_id).encode())
    return digest.digest()


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0
        """Prompt tokens looked up in the prefix cache."""
        self.prefix_hits = 0
        """Of those, tokens found."""

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.blocks.get(request_id, ())]

    def _update_hashes(self, request: Request) -> None:
        full = request.num_tokens // self.block_size
        tokens = request.all_token_ids
        for i in range(len(request.block_hashes), full):
            parent = request.block_hashes[i - 1] if i else None
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            request.block_hashes.append(block_key(parent, chunk, request.adapter_id))

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks that starts the request (not touched yet)."""
        self._update_hashes(request)
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:limit]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> bool:
        """Give `request` blocks for `num_new_tokens` more tokens after its computed ones (and
        after `computed`, the prefix hits it adopts now); False, changing nothing, if too few."""
        computed = computed or []
        owned = self.blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        need = cdiv(num_computed + num_new_tokens, self.block_size) - len(owned) - len(computed)
        revived = sum(1 for b in computed if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - revived:
            return False
        self.pool.touch(computed)
        owned.extend(computed)
        self.num_cached_blocks.setdefault(request.request_id, 0)
        self.num_cached_blocks[request.request_id] += len(computed)
        if need > 0:
            owned.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, request: Request, num_computed_after_step: int) -> None:
        """Register the blocks that are full once this step's tokens are computed."""
        if not self.pool.enable_prefix_caching:
            return
        self._update_hashes(request)
        owned = self.blocks[request.request_id]
        done = self.num_cached_blocks[request.request_id]
        full = min(num_computed_after_step // self.block_size, len(request.block_hashes))
        for i in range(done, full):
            self.pool.cache_block(owned[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(done, full)

    def free(self, request: Request) -> None:
        """Release every block of the request; its last blocks become the first to be evicted."""
        blocks = self.blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def num_slots_allocated(self) -> int:
        return sum(len(b) for b in self.blocks.values()) * self.block_size

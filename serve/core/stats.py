"""A per-step snapshot of the engine's state, for metrics, benchmarks and tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve.core.scheduler import Scheduler


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks_free: int
    num_preemptions: int
    """Since the engine started."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache, since the engine started."""
    prefix_cache_hits: int
    """Of those, tokens found."""
    num_scheduled_tokens: int
    """Tokens computed in the last step."""
    kv_waste: float
    """Unused slots in allocated blocks / allocated slots (0 when nothing is allocated)."""
    kv_usage: float
    """Used blocks / all blocks."""
    decode_paths: tuple[tuple[str, int], ...] = ()
    """Steps by how they ran once decode graphs are captured, since the engine started:
    ("graph", n) replayed, ("eager:<reason>", n) run eagerly (prefill, batch_size, lora);
    empty where every step runs eagerly by design (the CPU, `--enforce-eager`)."""

    @classmethod
    def snapshot(
        cls,
        sched: Scheduler,
        last_step_tokens: int,
        decode_paths: tuple[tuple[str, int], ...] = (),
    ) -> EngineStats:
        pool, kv = sched.pool, sched.kv
        allocated = kv.num_slots_allocated()
        in_use = sum(r.num_computed_tokens for r in sched.running)
        used = pool.num_blocks - pool.num_free_blocks
        return cls(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_blocks_used=used,
            num_blocks_free=pool.num_free_blocks,
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_scheduled_tokens=last_step_tokens,
            kv_waste=(allocated - in_use) / allocated if allocated else 0.0,
            kv_usage=used / pool.num_blocks,
            decode_paths=decode_paths,
        )

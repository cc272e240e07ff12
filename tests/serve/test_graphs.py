"""Decode graphs: buckets, capture order and pool against a mock backend, and through the CPU
stand-in (`ReplayGraphBackend`, which replays the recorded body over the same static buffers):
token-equal to eager steps at every bucket, padding that touches only the null block, and every
fallback counted where /metrics reads it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from serve import LLMEngine, SamplingParams
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.core.stats import EngineStats
from serve.engine.metrics import ServerMetrics
from serve.model.graphs import DecodeGraphs, ReplayGraphBackend, graph_buckets
from tests.serve.conftest import PAGED_CPU
from tests.workbench.greedy_check import greedy_outputs

BLOCK = 16


def test_buckets_are_powers_of_two_to_eight_then_steps_of_sixteen_then_the_limit() -> None:
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(1) == [1]
    graphs = DecodeGraphs(ReplayGraphBackend(), graph_buckets(20))
    assert [graphs.bucket_for(n) for n in (1, 3, 8, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]


class MockBackend:
    """Records each capture's pool and the body calls made before it."""

    def __init__(self, calls: list[tuple[str, int]]) -> None:
        self.calls, self.pools = calls, list[Any]()

    def new_pool(self) -> Any:
        self.calls.append(("new_pool", 0))
        return object()

    def warm_up(self, body: Callable[[], None]) -> None:
        self.calls.append(("warm_up", len(self.pools)))
        body()

    def capture(self, body: Callable[[], None], pool: Any) -> Any:
        self.pools.append(pool)
        self.calls.append(("capture", len(self.pools)))
        return MockGraph(body)


class MockGraph:
    def __init__(self, body: Callable[[], None]) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


def test_capture_warms_up_each_bucket_then_captures_largest_first_in_one_pool() -> None:
    calls: list[tuple[str, int]] = []
    backend = MockBackend(calls)
    graphs = DecodeGraphs(backend, [1, 2, 4, 8, 16])
    graphs.capture(lambda bucket: calls.append(("body", bucket)))
    expected = [("new_pool", 0)]
    for i, bucket in enumerate([16, 8, 4, 2, 1]):
        expected += [("warm_up", i), ("body", bucket), ("capture", i + 1)]
    assert calls == expected
    assert len(set(map(id, backend.pools))) == 1 and len(backend.pools) == 5
    calls.clear()
    graphs.replay(4)
    assert calls == [("body", 4)] and graphs.graph_steps == 1


def make_engine(
    model_dir: Path, backend: str, max_num_seqs: int = 20, graphs: bool = True
) -> LLMEngine:
    engine = LLMEngine(
        ModelConfig(str(model_dir), dtype="float32", device="cpu", attention_backend=backend),
        CacheConfig(block_size=BLOCK, num_blocks=256),
        SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=max_num_seqs),
    )
    if graphs:
        engine.runner.enable_graphs(ReplayGraphBackend(), max_num_seqs)
    return engine


@pytest.mark.parametrize("backend", ["reference", PAGED_CPU, "flex", "padded-sdpa"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_graph_decodes_are_token_equal_to_eager_at_every_bucket(
    model_dirs: dict[str, Path], arch: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 requests finishing one a step: decode batches of 20 down to 1 sequence replay every
    bucket (20, 16, 8, 4, 2, 1), each padded past its real rows. Gemma 3's sliding-window layers
    and soft-capped head included."""
    prompts = [[7 + (5 * i + j) % 50 for j in range(3 + i % 9)] for i in range(20)]
    lengths = [2 + i for i in range(20)]
    eager = greedy_outputs(make_engine(model_dirs[arch], backend, graphs=False), prompts, lengths)
    replayed: Counter[int] = Counter()
    original = DecodeGraphs.replay

    def replay(self: DecodeGraphs, bucket: int) -> None:
        replayed[bucket] += 1
        original(self, bucket)

    monkeypatch.setattr(DecodeGraphs, "replay", replay)
    engine = make_engine(model_dirs[arch], backend)
    assert greedy_outputs(engine, prompts, lengths) == eager
    assert set(replayed) == {20, 16, 8, 4, 2, 1}
    assert dict(engine.stats().decode_paths)["graph"] == sum(replayed.values())


def kv_slots(engine: LLMEngine) -> list[torch.Tensor]:
    """Every layer's K and V as [slots, kv_heads * head_dim] copies."""
    return [c.flatten(0, 1).flatten(1).clone() for pair in engine.runner.kv_caches for c in pair]


@pytest.mark.parametrize("backend", ["reference", PAGED_CPU, "flex", "padded-sdpa"])
def test_a_padded_step_leaves_every_block_but_its_own_slots_and_the_null_block_identical(
    model_dirs: dict[str, Path], backend: str
) -> None:
    engine = make_engine(model_dirs["llama"], backend, max_num_seqs=8)
    for i in range(3):
        engine.add_request(str(i), list(range(5 + i, 30 + 3 * i)), SamplingParams(max_tokens=8))
    engine.step()  # the prefills
    before = kv_slots(engine)
    engine.step()  # 3 decodes in the bucket of 4: one padded row
    real = set(engine.runner.buffers.view("slot_mapping", 3).tolist())
    assert len(real) == 3 and min(real) >= BLOCK
    for old, new in zip(before, kv_slots(engine)):
        changed = set((old != new).any(-1).nonzero().flatten().tolist())
        assert real <= changed <= real | set(range(BLOCK))
    assert dict(engine.stats().decode_paths)["graph"] == 1


def test_steps_graphs_cannot_run_are_counted_by_reason_and_reach_metrics(
    model_dirs: dict[str, Path],
) -> None:
    engine = make_engine(model_dirs["llama"], "reference", max_num_seqs=8, graphs=False)
    engine.runner.enable_graphs(ReplayGraphBackend(), 4)  # 8 may run, graphs hold up to 4
    for i in range(8):
        engine.add_request(str(i), [9, 10, 11 + i], SamplingParams(max_tokens=3 + (i >= 4)))
    while engine.has_unfinished_requests():
        engine.step()
    paths = dict(engine.stats().decode_paths)
    # prefill; 8 decodes x2 (too many); 4 decodes once (the last token of the 4 longer ones)
    assert paths == {"graph": 1, "eager:prefill": 1, "eager:batch_size": 2}
    metrics = ServerMetrics("m")
    metrics.observe_stats(engine.stats())
    text = metrics.render().decode()
    assert 'workbench:step_paths_total{model_name="m",path="eager:batch_size"} 2.0' in text
    assert 'workbench:step_paths_total{model_name="m",path="graph"} 1.0' in text
    metrics.observe_stats(EngineStats.snapshot(engine.scheduler, 0, (("graph", 4),)))
    assert (
        'workbench:step_paths_total{model_name="m",path="graph"} 4.0' in metrics.render().decode()
    )


def test_an_engine_on_the_cpu_runs_eagerly_and_reports_no_paths(
    model_dirs: dict[str, Path],
) -> None:
    engine = make_engine(model_dirs["llama"], "auto", graphs=False)
    assert engine.runner.graphs is None and engine.stats().decode_paths == ()


def test_sdpa_decodes_cannot_be_captured_and_say_so(model_dirs: dict[str, Path]) -> None:
    engine = make_engine(model_dirs["llama"], "sdpa", graphs=False)
    with pytest.raises(ValueError, match=r"builds decode metadata per step.*--enforce-eager"):
        engine.runner.enable_graphs(ReplayGraphBackend(), 4)


@pytest.fixture(scope="module")
def two_adapters(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    from tests.serve.test_lora_engine import ADAPTERS, make_adapter

    root = tmp_path_factory.mktemp("graph-adapters")
    names = ["qv4", "all8-rs"]
    return {
        n: make_adapter(model_dirs["llama"], root / n, i, **ADAPTERS[n])
        for i, n in enumerate(names)
    }


def test_mixed_adapter_decodes_replay_graphs_token_equal_to_eager_across_a_hot_swap(
    model_dirs: dict[str, Path], two_adapters: dict[str, Path]
) -> None:
    """Requests on two adapters and on the base decode together from the graphs (rows gather
    their slot's A and B); an adapter loaded mid-flight takes a slot the graphs already read."""
    from tests.serve.test_lora_engine import lora_engine

    def run(graphs: bool) -> tuple[dict[str, list[int]], dict[str, int]]:
        engine = lora_engine(model_dirs["llama"], max_loras=3)
        if graphs:
            engine.runner.enable_graphs(ReplayGraphBackend(), 8)
        v = {n: engine.load_lora(n, str(p)) for n, p in two_adapters.items()}
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for i, version in enumerate([None, v["qv4"], v["all8-rs"], v["qv4"]]):
            engine.add_request(f"r{i}", [11 + i, 40, 41, 42 + i], params, adapter_id=version)
        done: dict[str, list[int]] = {}
        for step in range(40):
            if step == 3:  # a new version of qv4's weights under another name, mid-flight
                late = engine.load_lora("late", str(two_adapters["all8-rs"]))
                engine.add_request("late", [12, 40, 41], params, adapter_id=late)
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            if not engine.has_unfinished_requests():
                break
        return done, dict(engine.stats().decode_paths)

    eager, _ = run(graphs=False)
    replayed, paths = run(graphs=True)
    assert replayed == eager and len(eager) == 5
    assert paths["graph"] >= 8 and "eager:lora" not in paths

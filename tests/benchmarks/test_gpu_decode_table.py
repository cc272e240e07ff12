"""The GPU decode table's logic on the CPU: the hand-written model configs, the RTN int4 copy,
the roofline's bytes, the busy fraction, the table and the targets, and a whole dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.gpu_decode_table import SYSTEMS, Row, main, table, targets
from benchmarks.gpu_models import (
    build_model,
    llama_3_1_8b,
    llama_3_2_1b,
    rtn_int4,
    synthetic_tokenizer,
    tiny,
)
from benchmarks.roofline import busy_fraction, kv_bytes_read, peak_bandwidth, weight_bytes
from benchmarks.step_bench import DECODE_STEPS
from compress.packed import PackedLinear4


@pytest.mark.parametrize(
    ("config", "parameters"), [(llama_3_2_1b, 1_235_814_400), (llama_3_1_8b, 8_030_261_248)]
)
def test_the_hand_written_configs_have_the_published_models_parameter_counts(
    config, parameters: int
) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config())
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_the_int4_copy_packs_the_decoder_linears_and_keeps_the_head() -> None:
    model = build_model(tiny(llama_3_1_8b()), torch.device("cpu"))
    int4 = rtn_int4(model)
    packed = [n for n, m in int4.named_modules() if isinstance(m, PackedLinear4)]
    assert len(packed) == 2 * 7 and all(n.startswith("model.layers.") for n in packed)
    assert all(m.group_size == 128 for m in int4.modules() if isinstance(m, PackedLinear4))
    assert isinstance(int4.lm_head, torch.nn.Linear)
    assert not any(isinstance(m, PackedLinear4) for m in model.modules())  # a copy
    assert weight_bytes(int4) < weight_bytes(model)


def test_weight_bytes_skip_the_embedding_table_unless_the_head_reads_it() -> None:
    untied = build_model(tiny(llama_3_1_8b()), torch.device("cpu"))
    every = sum(p.numel() * 2 for p in untied.parameters())
    table_bytes = 512 * 128 * 2
    rotary = sum(b.numel() * b.element_size() for b in untied.buffers())
    assert weight_bytes(untied) == every - table_bytes + rotary
    tied = build_model(tiny(llama_3_2_1b()), torch.device("cpu"))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    every = sum(p.numel() * 2 for p in tied.parameters())  # the shared table counted once
    assert weight_bytes(tied) == every + sum(b.numel() * b.element_size() for b in tied.buffers())


def test_kv_bytes_are_every_sequences_mean_context_in_k_and_v() -> None:
    model = build_model(tiny(llama_3_1_8b()), torch.device("cpu"))
    per_token = 2 * 2 * 2 * 32 * 2  # K and V, 2 layers, 2 KV heads, head dim 32, bfloat16
    mean_context = 100 + (DECODE_STEPS + 1) / 2
    assert kv_bytes_read(model, 3, 100) == int(3 * mean_context * per_token)


@pytest.mark.parametrize(
    ("name", "bandwidth"),
    [("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H200", 4.8e12)],
)
def test_the_peak_bandwidth_is_read_by_device_name(
    name: str, bandwidth: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("torch.cuda.get_device_name", lambda device: name)
    assert peak_bandwidth(torch.device("cuda")) == (bandwidth, f"{name}: vendor peak")


def test_elsewhere_the_bandwidth_is_a_measured_copy() -> None:
    bandwidth, source = peak_bandwidth(torch.device("cpu"))
    assert bandwidth > 0 and source == "cpu: measured copy"


def test_the_busy_fraction_is_the_union_of_gpu_intervals_over_the_wall_time() -> None:
    """Overlapping kernels (two streams) count once; gaps do not count."""
    intervals = [(0.0, 1.0), (0.5, 2.0), (3.0, 3.5), (3.1, 3.2)]
    assert busy_fraction(intervals, 5.0) == pytest.approx(2.5 / 5.0)
    assert busy_fraction([], 1.0) is None


def _rows(graphs_25m: float, busy: float) -> list[Row]:
    rows = []
    for model in ("llama-25m", "llama-3.1-8b"):
        for system in SYSTEMS:
            seconds = {"generate": 0.0086, "engine-graphs": graphs_25m}.get(system, 0.005)
            if model == "llama-3.1-8b":
                seconds = {"engine-graphs": 0.012, "engine-graphs-int4": 0.005}.get(system, 0.02)
            rows.append(Row(model, system, 1 if model != "llama-25m" else 64, seconds, 0.01, busy))
    return rows


def test_the_table_and_the_targets_give_each_figure() -> None:
    rows = _rows(graphs_25m=0.004, busy=0.9)
    text = table(rows)
    assert "### llama-25m" in text and "| sequences | generate | engine-eager |" in text
    assert "| 64 | 8.6 ms (x0.9 roofline, busy 90%) |" in text
    lines = targets(rows)
    assert "- 25M, 64 sequences: engine graphs >= 2x faster than generate: 2.15 (met)" in lines
    assert "- llama-3.1-8b, 1 sequences: within 1.5x of the roofline: 1.20 (met)" in lines
    assert "- llama-3.1-8b, 16 sequences: within 1.5x of the roofline: unmeasured" in lines
    assert "- 8B, 1 sequence: int4 >= 2x faster than bfloat16: 2.40 (met)" in lines
    assert "- llama-3.2-1b, 1 sequences: within 1.5x of the roofline: unmeasured" in lines
    assert "- llama-25m, 64 sequences: GPU busy >= 85%: 0.90 (met)" in lines
    slow = targets(_rows(graphs_25m=0.006, busy=None))  # type: ignore[arg-type]
    assert "- 25M, 64 sequences: engine graphs >= 2x faster than generate: 1.43 (not met)" in slow
    assert "- llama-25m, 64 sequences: GPU busy >= 85%: unmeasured" in slow


def test_the_synthetic_tokenizer_covers_the_models_vocabulary() -> None:
    tokenizer = synthetic_tokenizer(128256)
    assert len(tokenizer) == 128256
    assert tokenizer.decode([5, 128255]) == "t5 t128255"


def test_a_dry_run_measures_every_system_and_writes_the_table(tmp_path: Path) -> None:
    """The same code paths as on a GPU (engines over the in-memory model, generate, int4,
    the profiler), tiny models on the CPU."""
    assert (
        main(["--dry-run", "--models", "llama-3.2-1b", "--batches", "1,2", "--out", str(tmp_path)])
        == 0
    )
    rows = json.loads((tmp_path / "table.json").read_text())
    assert [(r["system"], r["sequences"]) for r in rows] == [
        (s, n) for n in (1, 2) for s in SYSTEMS
    ]
    assert all(r["seconds"] > 0 and r["roofline_seconds"] > 0 for r in rows)
    assert all(r["busy"] is None for r in rows)  # no GPU here
    assert "### llama-3.2-1b" in (tmp_path / "table.md").read_text()


def test_the_graph_systems_replay_decode_graphs_in_a_dry_run_too() -> None:
    """On the CPU the graph systems take the stand-in graph backend, so the dry run goes
    through the engine's buckets and static buffers; the eager system has no graphs."""
    from benchmarks.gpu_decode_table import make_engine

    model = build_model(tiny(llama_3_2_1b()), torch.device("cpu"))
    tokenizer = synthetic_tokenizer(512)
    graphs = make_engine(model, tokenizer, (1, 4), 16, eager=False)
    assert graphs.runner.graphs is not None
    assert make_engine(model, tokenizer, (1, 4), 16, eager=True).runner.graphs is None

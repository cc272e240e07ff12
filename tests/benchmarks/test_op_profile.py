"""The op-family profile's arithmetic: self times from nested Chrome trace events, families of
both systems' operator names, and the time outside operators."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.op_profile import (
    KERNEL_EVENTS,
    by_family,
    family,
    linears_by_rows,
    self_times,
    top_operators,
    trace_events,
    traced_attention_kernels,
)


def _op(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def test_self_time_is_an_events_duration_less_its_childrens_on_its_thread() -> None:
    events = [
        _op("aten::linear", 0, 100),
        _op("aten::addmm", 10, 30),
        _op("aten::copy_", 15, 5),  # inside addmm
        _op("aten::add", 50, 10),
        _op("aten::mul", 20, 50, tid=2),  # another thread: not a child
        {"ph": "X", "cat": "user_annotation", "name": "execute_model", "ts": 0, "dur": 500},
        {"ph": "i", "cat": "cpu_op", "name": "marker", "ts": 3},
    ]
    times = self_times(events)
    assert times == {
        "aten::linear": 60,
        "aten::addmm": 25,
        "aten::copy_": 5,
        "aten::add": 10,
        "aten::mul": 50,
    }


def test_repeated_ops_add_up_and_siblings_do_not_nest() -> None:
    events = [_op("aten::mm", 0, 10), _op("aten::mm", 10, 10), _op("aten::mm", 25, 5)]
    assert self_times(events) == {"aten::mm": 25}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mkldnn::_linear_pointwise", "linears"),
        ("_C::onednn_mm", "linears"),
        ("aten::addmm", "linears"),
        ("_C::cpu_attention_with_kv_cache", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("workbench::paged_attention", "attention"),
        ("_C::cpu_attn_reshape_and_cache", "kv write / gather"),
        ("vllm::unified_kv_cache_update", "kv write / gather"),
        ("aten::index_copy_", "kv write / gather"),
        ("_C::greedy_argmax", "sampling"),
        ("aten::argmax", "sampling"),
        ("aten::silu", "elementwise"),
        ("aten::mul", "elementwise"),
        ("## Call CompiledFxGraph None ##", "other operators"),
        ("aten::empty", "other operators"),
    ],
)
def test_operator_families(name: str, expected: str) -> None:
    assert family(name) == expected


def test_by_family_puts_the_rest_of_the_wall_time_outside_operators() -> None:
    out = by_family({"aten::mm": 3000, "aten::mul": 500, "aten::empty": 500}, wall_us=10_000)
    assert out == {
        "linears": 3.0,
        "elementwise": 0.5,
        "other operators": 0.5,
        "outside operators": 6.0,
    }


def test_the_engines_attention_kernels_count_as_attention(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The paged-cpu kernels are ctypes calls: traced, the profile sees each as its own event
    and counts it as attention, not as time outside operators."""
    import torch

    from benchmarks.engine_bench import engine_for, run_engine
    from benchmarks.workloads import Workload

    engine = engine_for(tiny_model_dir, 1 << 20)
    traced_attention_kernels(engine)
    w = Workload("decode", [[5, 6, 7, 8]] * 2, [4, 4])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_engine(engine, w)
    prof.export_chrome_trace(str(tmp_path / "engine.json"))
    times = self_times(trace_events([tmp_path / "engine.json"]))
    kernels = [times[name] for name in KERNEL_EVENTS.values()]
    assert all(t > 0 for t in kernels)  # 4-token prefills, then decodes
    assert {family(name) for name in KERNEL_EVENTS.values()} == {"attention"}
    # summed in another order than the kernels alone: equal to within a rounding when the
    # kernels are all the attention there is
    attention_ms = by_family(times, wall_us=1e9)["attention"]
    assert attention_ms >= sum(kernels) / 1000 * (1 - 1e-12)


def test_top_operators_are_each_familys_largest_in_order() -> None:
    times = {
        "aten::mm": 3000.0,
        "aten::addmm": 5000.0,
        "mkldnn::_linear_pointwise": 1000.0,
        "aten::mul": 700.0,
        "aten::empty": 10.0,
    }
    assert top_operators(times, 2) == {
        "linears": [("aten::addmm", 5.0), ("aten::mm", 3.0)],
        "elementwise": [("aten::mul", 0.7)],
        "other operators": [("aten::empty", 0.01)],
    }


def test_linears_are_split_by_product_shape_in_each_operators_argument_order() -> None:
    """A decode step's products (one row per sequence) and a prefill chunk's (one per token)
    land in separate cells, read from each operator's own arguments (vLLM's `onednn_mm` takes
    its output first); other operators and unrecorded shapes are left out."""

    def shaped(name: str, dims: list[list[int]], dur: float) -> dict:
        return {**_op(name, 0, dur), "args": {"Input Dims": dims}}

    events = [
        shaped("mkldnn::_linear_pointwise", [[1, 64, 512], [2560, 512], [], []], 1500),
        shaped("mkldnn::_linear_pointwise", [[64, 512], [2560, 512], [], []], 500),
        shaped("mkldnn::_linear_pointwise", [[1024, 512], [1024, 512], [], []], 8000),
        shaped("_C::onednn_mm", [[64, 2560], [64, 512], [], [1]], 700),
        shaped("aten::addmm", [[512], [16, 1280], [1280, 512], [], []], 300),
        shaped("aten::mm", [[8, 1280], [1280, 512]], 200),
        shaped("aten::linear", [[], [], []], 9000),
        shaped("aten::add", [[64, 512], [64, 512]], 30),
        _op("aten::mm", 0, 100),
    ]
    assert linears_by_rows(events) == {
        "64 x 512 -> 2560": (3, pytest.approx(2.7)),
        "1024 x 512 -> 1024": (1, 8.0),
        "16 x 1280 -> 512": (1, 0.3),
        "8 x 1280 -> 512": (1, 0.2),
    }

"""The engine benchmark's workloads, its engine runs (outputs equal `generate`'s) and its
summary against the other systems, vLLM included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.engine_bench import Measured, SystemRuns, run_engine, summarize
from benchmarks.workloads import Workload, make_workload


def test_the_engine_issue_workloads_have_their_stated_lengths() -> None:
    uniform = make_workload("uniform", 32, 100)
    assert {len(p) for p in uniform.prompts} == {128} and set(uniform.max_tokens) == {64}
    prefill = make_workload("prefill-bound", 4, 100)
    assert prefill.counted_tokens == 4 * (256 + 1)  # prompt tokens count where prefill is timed
    decode = make_workload("decode-bound", 4, 100)
    assert decode.counted_tokens == decode.output_tokens == 4 * 128
    mixed = make_workload("mixed-256", 200, 100)
    assert min(map(len, mixed.prompts)) >= 16 and max(map(len, mixed.prompts)) <= 256
    assert min(mixed.max_tokens) >= 16 and max(mixed.max_tokens) <= 128
    with pytest.raises(ValueError, match="decode-bound"):
        make_workload("bursty", 4, 100)


def test_the_summary_sets_the_engine_against_vllm_round_by_round(tiny_model_dir: Path) -> None:
    from benchmarks.engine_bench import engine_for

    w = make_workload("uniform", 3, 500)
    w = Workload(w.name, [p[:8] for p in w.prompts], [4, 4, 4])
    engine = engine_for(tiny_model_dir, 1 << 20)
    measured = run_engine(engine, w)
    assert measured.outputs is not None and [len(o) for o in measured.outputs] == [4, 4, 4]
    other = [list(o) for o in measured.outputs]
    other[2] = [t + 1 for t in other[2]]  # one request differs
    systems = [
        SystemRuns("engine", lambda: measured, [Measured(1.0, outputs=measured.outputs)] * 2),
        SystemRuns("static-16", lambda: measured, [Measured(3.0)] * 2),
        SystemRuns("static-64", lambda: measured, [Measured(2.0)] * 2),
        SystemRuns("hf-continuous", lambda: measured, [Measured(4.0)] * 2),
        SystemRuns("vllm", lambda: measured, [Measured(1.5), Measured(0.5, outputs=other)]),
    ]
    summary = summarize(systems, w, lambda line: None)
    assert summary["best_static"] == "static-64"
    assert summary["vs_vllm"] == (1.0, 0.5, 1.5)  # their seconds / ours, per round
    assert summary["same_outputs_as_vllm"] == pytest.approx(2 / 3)
    assert summary["tokens_per_s"]["vllm"] == pytest.approx(12 / 1.0)


def test_the_engine_benchmark_answers_as_generate_does(tiny_model_dir: Path) -> None:
    """The engine's outputs in the benchmark are transformers' greedy continuations."""
    import torch

    from benchmarks.bench_models import load_baseline_model
    from benchmarks.engine_bench import engine_for

    w = make_workload("mixed-256", 2, 500, seed=3)
    w = Workload(w.name, [p[:12] for p in w.prompts], [5, 7])
    measured = run_engine(engine_for(tiny_model_dir, 1 << 20), w)
    model = load_baseline_model(tiny_model_dir)
    generate: Any = model.generate  # typed by transformers as a tensor attribute
    for prompt, n, out in zip(w.prompts, w.max_tokens, measured.outputs or []):
        ids = torch.tensor([prompt])
        generated = generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None
        )
        assert out == generated[0, len(prompt) :].tolist()


def test_the_parameter_count_is_the_architectures(tiny_model_dir: Path) -> None:
    """The benchmark reports the pipeline's count: the architecture's, no weights read."""
    from benchmarks.bench_models import load_baseline_model
    from workbench.model_shape import parameter_count

    model = load_baseline_model(tiny_model_dir)
    assert parameter_count("model", tiny_model_dir) == sum(p.numel() for p in model.parameters())

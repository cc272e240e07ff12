"""`--compile`: the step forward through `torch.compile` gives `generate`'s greedy tokens, builds
its graphs once at load (none while serving, whatever the batch shapes), and is refused, with the
reason, where it cannot serve."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch._dynamo.utils import counters

from serve import LLMEngine
from serve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from serve.lora.registry import LoraConfig
from serve.model.compilation import WARM_UP_SHAPES, cxx_compiler, why_not_compilable
from tests.serve.conftest import PAGED_CPU, Case
from tests.serve.test_engine_exact import run

needs_cxx = pytest.mark.skipif(
    cxx_compiler() is None,
    reason="no C++ compiler: torch.compile's CPU backend (inductor) cannot build kernels here",
)


def compiled_engine(model_dir: Path, backend: str, **sched: int) -> LLMEngine:
    return LLMEngine(
        ModelConfig(str(model_dir), "float32", "cpu", backend, compile=True),
        CacheConfig(block_size=16, num_blocks=64),
        SchedulerConfig(**sched),
    )


@needs_cxx
@pytest.mark.slow  # inductor compiles four graphs per backend (seconds each, cached after)
@pytest.mark.parametrize("backend", [PAGED_CPU, "sdpa"])
def test_compiled_engine_matches_generate_without_recompiling(
    model_dirs: dict[str, Path],
    cases: list[Case],
    references: dict[str, list[list[int]]],
    backend: str,
) -> None:
    # a small token budget and KV pool: chunked prefills, chunks that sample nothing, mixed
    # batches, single decodes and preemption all occur
    engine = compiled_engine(model_dirs["llama"], backend, max_num_batched_tokens=96)
    report = engine.runner.compile_report
    assert report is not None
    # all four graphs are new, or all reused from the other parametrization's model (same
    # architecture and shapes: dynamo's guards do not pin a module instance)
    assert report.graphs in (len(WARM_UP_SHAPES), 0)
    assert report.graph_breaks == 0
    graphs = counters["stats"]["unique_graphs"]
    outputs = run(engine, cases)
    assert outputs == dict(enumerate(references["llama"]))
    assert engine.stats().num_preemptions > 0
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled while serving
    assert engine.runner.compiled is not None
    assert engine.runner.compiled.eager_steps == 0  # and every step ran a graph


def test_compile_with_lora_is_refused_with_the_reason(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"LoRA adapters.*drop --compile"):
        LLMEngine(
            ModelConfig(str(model_dirs["llama"]), "float32", "cpu", compile=True),
            CacheConfig(num_blocks=64),
            lora=LoraConfig(max_loras=2),
        )


@needs_cxx
def test_compile_of_a_quantized_model_is_refused(model_dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    assert why_not_compilable(model, lora=False) is None
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    assert "quantized" in str(why_not_compilable(model, lora=False))


@needs_cxx
@pytest.mark.slow  # inductor compiles four graphs (seconds each, cached after)
def test_compiled_engine_on_an_int8_kv_cache_gives_the_uncompiled_tokens(
    model_dirs: dict[str, Path], cases: list[Case]
) -> None:
    """The paged op stays opaque to the compiler and writes and reads the int8 cache as the
    eager forward does."""

    def engine(compile_model: bool) -> LLMEngine:
        return LLMEngine(
            ModelConfig(str(model_dirs["llama"]), "float32", "cpu", compile=compile_model),
            CacheConfig(block_size=16, num_blocks=64, kv_cache_dtype="int8"),
            SchedulerConfig(max_num_batched_tokens=96),
        )

    compiled = engine(True)
    assert compiled.runner.compile_report is not None
    assert compiled.runner.compile_report.graph_breaks == 0
    assert run(compiled, cases[:12]) == run(engine(False), cases[:12])


@needs_cxx
@pytest.mark.slow  # inductor compiles four graphs (seconds each, cached after)
def test_compiled_graphs_run_when_the_caller_is_in_inference_mode(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller's `torch.inference_mode()` (benchmarks, lm-eval) must not make the step inputs
    tensors of another kind than the warm-up's: their guards would fail and every step would
    run eagerly. Steps in and out of inference mode run the compiled graphs: none is counted
    as an eager step."""
    import torch

    from serve import SamplingParams

    engine = compiled_engine(model_dirs["llama"], "auto")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i, mode in enumerate((torch.inference_mode, torch.no_grad, torch.enable_grad)):
        with mode():
            engine.add_request(f"r{i}", [1, 2, 3, 4, 5], params)
            engine.add_request(f"s{i}", [6, 7, 8], params)
            while engine.has_unfinished_requests():
                engine.step()
    assert engine.runner.compiled is not None
    assert engine.runner.compiled.eager_steps == 0
    assert engine.stats().num_running == 0


@needs_cxx
def test_inputs_no_graph_covers_run_eagerly_and_are_counted() -> None:
    """After the warm-up, a call whose guards fail (here: another dtype) is not compiled: it
    runs the eager module, gives its result, and counts one eager step."""
    import torch

    from serve.model.compilation import CompiledForward

    class Scale(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * 2).sin() + 1

    forward = CompiledForward(Scale())
    warm = torch.arange(6, dtype=torch.float32)
    assert torch.allclose(forward(x=warm), Scale()(warm))  # compiled: equal up to rounding
    forward.warm = True
    graphs = counters["stats"]["unique_graphs"]
    assert torch.allclose(forward(x=warm + 1), Scale()(warm + 1))
    assert forward.eager_steps == 0
    other = torch.arange(6, dtype=torch.float64)
    assert torch.equal(forward(x=other), Scale()(other))  # eager: the same ops, bit for bit
    assert forward.eager_steps == 1
    assert counters["stats"]["unique_graphs"] == graphs

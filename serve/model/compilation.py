"""`torch.compile` of the model's whole step forward (opt-in: `--compile`).

Model: one graph covers every step of a shape class. The step's token count T and its count of
kept logits rows R are symbolic; dynamo specialises sizes 0 and 1, so the classes are one decode
(T = 1, R = 1), a batch (T > 1, R > 1), one sequence's prefill (T > 1, R = 1) and a chunk that
samples nothing (T > 1, R = 0). Attention (`workbench::paged_attention`) and the prepacked linears
(`workbench::packed_linear`) are opaque custom ops; inductor fuses what lies between them (RMSNorm,
RoPE, SiLU x up, residual adds) and drops the per-op Python of the HF modules.

`warm_up` compiles the four classes at load on dummy steps that write only free KV blocks (their
contents are never read before a real step writes them), and reports the graphs and seconds. After
it, a step that would need another graph runs eagerly: serving never stops for a compile, and such
steps are counted (`CompiledForward.eager_steps`), not hidden.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.utils import counters
from transformers import PreTrainedModel

from serve.core.block_pool import NULL_BLOCK_ID
from serve.core.kv_cache_manager import cdiv
from serve.core.scheduler import ScheduledChunk, SchedulerOutput

WARM_UP_SHAPES: tuple[tuple[tuple[int, bool], ...], ...] = (
    ((3, True), (2, True)),  # T > 1, R > 1
    ((3, True),),  # T > 1, R = 1
    ((3, False),),  # T > 1, R = 0
    ((1, True),),  # T = 1, R = 1
)
"""Each warm-up step as its chunks' (tokens, samples)."""


@dataclass(frozen=True)
class CompileReport:
    graphs: int
    """Graphs dynamo compiled during the warm-up (0 when a model of the same architecture and
    shapes was compiled before in this process: dynamo reuses those graphs)."""
    graph_breaks: int
    seconds: float

    def line(self) -> str:
        return (
            f"torch.compile: {self.graphs} graph(s), {self.graph_breaks} graph break(s), "
            f"{self.seconds:.1f} s at load"
        )


def cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would use ($CXX, else the first on PATH)."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((path for name in names if (path := shutil.which(name))), None)


def why_not_compilable(model: PreTrainedModel, lora: bool) -> str | None:
    """Why `--compile` cannot serve this model, or None."""
    if model.device.type == "cpu" and cxx_compiler() is None:
        return "no C++ compiler (g++, c++, clang++ or $CXX) for inductor's CPU kernels"
    if lora:
        return "LoRA adapters change which rows each layer touches every step"
    config = model.config.get_text_config()
    if getattr(model, "hf_quantizer", None) or getattr(config, "quantization_config", None):
        return "the model is quantized; compile serves float models"
    if any(type(p.data) is not torch.Tensor for p in model.parameters()):
        return "the model holds quantized tensor subclasses; compile serves float models"
    return None


class CompiledForward:
    """The model's forward through `torch.compile`, eager for inputs the warm-up's graphs do not
    cover (their guards fail): such steps are counted in `eager_steps`, never compiled."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.compiled = torch.compile(model, dynamic=True)
        self.warm = False
        self.eager_steps = 0

    def __call__(self, **inputs: Any) -> Any:
        if not self.warm:
            return self.compiled(**inputs)
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self.compiled(**inputs)
        except RuntimeError as e:  # raised by the guard check, before the graph runs
            if "fail_on_recompile" not in str(e):
                raise
        self.eager_steps += 1
        return self.model(**inputs)


def warm_up(
    forward: CompiledForward,
    execute: Callable[[SchedulerOutput], object],
    block_size: int,
    num_blocks: int,
) -> CompileReport:
    """Run `execute` on one dummy step of each shape class (blocks from 1 up, all free now;
    block 0 is the null block)."""
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    start = time.perf_counter()
    for shape in WARM_UP_SHAPES:
        chunks, next_block = [], NULL_BLOCK_ID + 1
        for i, (tokens, sample) in enumerate(shape):
            blocks = cdiv(tokens, block_size)
            if next_block + blocks > num_blocks + 1:
                raise ValueError(f"the KV cache ({num_blocks} blocks) is too small to warm up")
            table = list(range(next_block, next_block + blocks))
            next_block += blocks
            ids = [1 + (i + j) % 7 for j in range(tokens)]
            chunks.append(ScheduledChunk(f"warm-up-{i}", ids, 0, table, sample))
        execute(SchedulerOutput(chunks))
    forward.warm = True
    return CompileReport(
        counters["stats"]["unique_graphs"] - graphs,
        sum(counters["graph_break"].values()) - breaks,
        time.perf_counter() - start,
    )

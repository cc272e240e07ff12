"""The engine's C kernels, built ahead of their first use.

Model: each kernel's loader builds its library on first use (`serve.model.native`); a process
that knows it will run the engine later (a recipe whose evals do) starts every build at once in
the background instead, so the compiler runs beside work that leaves a core free (a first run's
GGUF conversion and quantization) rather than in front of the first evaluation.
"""

from __future__ import annotations

import threading
from pathlib import Path

from serve.model.native import build_in_background


def engine_kernels() -> list[tuple[Path, list[str]]]:
    """(source, flags) of every library the engine's CPU path loads."""
    from serve.model import bnb_linear, cpu_attention, fused_ops, greedy

    return [
        (cpu_attention.SOURCE, cpu_attention.COMPILE),
        (cpu_attention.PREFILL_SOURCE, cpu_attention.COMPILE),
        (fused_ops.SOURCE, fused_ops.COMPILE),
        (greedy.SOURCE, greedy.COMPILE),
        (bnb_linear.SOURCE, bnb_linear.COMPILE),
    ]


def prebuild_engine_kernels() -> list[threading.Thread]:
    """Start building the engine's kernels in the background; the threads building them."""
    return build_in_background(engine_kernels())

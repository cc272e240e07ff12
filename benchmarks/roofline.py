"""What a decode step must cost at least, and how busy it kept the GPU.

Model: a decode step reads every weight once (but the input embedding's untouched rows) and the
K and V of every sequence's context; at the device's peak memory bandwidth that is its
roofline. The GPU busy fraction is the union of the GPU's activity intervals that
`torch.profiler` records over the step's wall time (the profiler's overhead makes it a lower
bound); off the GPU there are none and it is None.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from benchmarks.step_bench import DECODE_STEPS, _synchronize
from serve.model.model_runner import kv_layout

PEAK_BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))
"""Vendor peak memory bandwidth (bytes/s) by device name, first match (H100 alone: SXM)."""


def weight_bytes(model: PreTrainedModel) -> int:
    """Bytes of weights a decode step reads: every parameter and buffer, less the input
    embedding's table unless the head reads it too (a tied head)."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    skip = set() if head is not None and _tied(model) else {id(t) for t in _tensors(embedding)}
    return sum(t.numel() * t.element_size() for t in _tensors(model) if id(t) not in skip)


def _tied(model: PreTrainedModel) -> bool:
    return bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    unique = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return list(unique.values())


def kv_bytes_read(model: PreTrainedModel, n: int, context: int) -> int:
    """K and V bytes that the mean timed decode step of `n` sequences of `context` prompt
    tokens reads (the context grows by one token a step)."""
    per_token = kv_layout(model, torch.bfloat16).bytes_per_token()
    return int(n * (context + (DECODE_STEPS + 1) / 2) * per_token)


def peak_bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes/s, where from): the vendor peak by device name, else a measured copy."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, bandwidth in PEAK_BANDWIDTH:
            if key in name:
                return bandwidth, f"{name}: vendor peak"
    return copy_bandwidth(device), f"{device.type}: measured copy"


def copy_bandwidth(device: torch.device, size: int = 1 << 26) -> float:
    """Bytes read and written per second by a device-to-device copy of `size` bytes."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    _synchronize(device)
    return 2 * 5 * size / (time.perf_counter() - start)


def busy_fraction(intervals: list[tuple[float, float]], wall: float) -> float | None:
    """The share of `wall` seconds covered by the union of GPU activity `intervals` (seconds);
    None without any (a CPU run)."""
    if not intervals:
        return None
    covered, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            covered += b - max(a, end)
            end = b
    return covered / wall


def profiled(run: Callable[[], object], device: torch.device) -> float | None:
    """GPU busy fraction of `run` (see the module's docstring)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        wall = time.perf_counter() - start
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return busy_fraction([(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in gpu], wall)

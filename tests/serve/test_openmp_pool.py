"""The loader's OpenMP workers are released before the engine thread computes: one pool per
process (two made every parallel region of the engine wake its workers through the kernel)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from serve.model.openmp_pool import _runtime, release_thread_pool

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or _runtime() is None or torch.get_num_threads() < 2,
    reason="needs Linux, an OpenMP runtime that can pause and at least two torch threads",
)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled(want: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout
    while _threads() != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads()


def test_release_frees_the_calling_threads_openmp_workers() -> None:
    """On a thread of its own (the test runner's main thread may own a pool already): a
    parallel region makes `threads - 1` workers, releasing frees them, computing again makes
    them again."""
    seen: dict[str, int | bool] = {}

    def compute() -> None:
        big = torch.randn(512, 512)
        seen["before"] = _threads()
        big @ big  # a parallel region
        seen["computing"] = _threads()
        seen["released"] = release_thread_pool()
        seen["after"] = _settled(int(seen["before"]))
        big @ big
        seen["again"] = _threads()

    t = threading.Thread(target=compute)
    t.start()
    t.join()
    workers = torch.get_num_threads() - 1
    assert seen["computing"] == seen["before"] + workers
    assert seen["released"] is True
    assert seen["after"] == seen["before"]
    assert seen["again"] == seen["before"] + workers

"""Task stand-ins that Ray workers import without the workbench (a light module: each GPU task
starts a fresh worker process)."""

from __future__ import annotations

import os
from typing import Any


class GpuProbe:
    """Stands in for a run's tasks to see where Ray put each: its GPU ids and its process."""

    def __call__(self, node: Any, inputs: dict[str, Any]) -> tuple[list[int], int]:
        import ray

        return [int(i) for i in ray.get_gpu_ids()], os.getpid()

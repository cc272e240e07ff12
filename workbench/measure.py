"""Peak resident memory of this process over a block of code (a sampling thread), and versions."""

from __future__ import annotations

import importlib.metadata
import os
import resource
import threading
import time
from types import TracebackType

_PAGE = os.sysconf("SC_PAGE_SIZE")
PACKAGES = (
    "workbench",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "peft",
    "bitsandbytes",
    "accelerate",
)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux: the lifetime peak is the best there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """`with PeakMemory() as peak: ...` then `peak.bytes` (host RSS) and `peak.cuda_bytes`."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.bytes = 0
        self.cuda_bytes: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.bytes = max(self.bytes, rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakMemory:
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self.bytes = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        import torch

        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, rss_bytes())
        if torch.cuda.is_available():
            self.cuda_bytes = torch.cuda.max_memory_allocated()


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out

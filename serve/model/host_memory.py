"""Keep freed host memory in the process, so a CPU forward does not page-fault on every tensor.

Model: glibc's malloc serves blocks above its mmap threshold (128 KiB at start, raised as large
blocks are freed, at most 32 MiB) with fresh `mmap`s that it unmaps on free, and returns the
heap's free top above the trim threshold to the kernel. A CPU forward allocates and frees
tensors of megabytes in every layer (a 1,024-token prefill of a 512-wide model: 2-5 MiB each),
and training and scoring over a vocabulary free and allocate again blocks of 100 MiB or more a
step (SmolLM2's logits of 512 positions in float32, its embedding's gradient): without tuning
each of them is new memory that the kernel zeroes and faults in page by page, which took about
a quarter of a 25M Llama's prefill (396 -> 305 ms) and a sixth of a SmolLM2 distillation step
(2.26 -> 1.90 s; `docs/measured/cpu-runtime.md#2026-12-05-host-memory`). vLLM's CPU backend gets the
same effect by preloading tcmalloc.

`keep_freed_memory` serves every block from the heap (no mmap at any size; the mmap threshold
also at its glibc maximum, for a C library that mmaps anyway) and sets the trim threshold high,
so freed blocks are reused instead of unmapped. It is process-wide, keeps the peak of what was
freed resident until the process exits, and is done once; it does nothing where libc is not
glibc, or where the user tuned malloc already (any `MALLOC_*_` variable, `glibc.malloc`
tunables, or `LD_PRELOAD` naming an allocator), and it is switched off by
`WORKBENCH_KEEP_FREED_MEMORY=0`. The engines call it when they are built; `workbench`'s
commands at their start, so training and quantization get it too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
MMAP_THRESHOLD = 32 << 20
"""glibc's largest accepted mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)."""
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

OFF_SWITCH = "WORKBENCH_KEEP_FREED_MEMORY"

_done: bool | None = None


def _user_tuned() -> bool:
    if os.environ.get(OFF_SWITCH) == "0":
        return True
    if any(name.startswith("MALLOC_") and name.endswith("_") for name in os.environ):
        return True
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return True
    preload = os.environ.get("LD_PRELOAD", "")
    return any(name in preload for name in ("tcmalloc", "jemalloc", "mimalloc"))


def keep_freed_memory() -> bool:
    """Tune glibc malloc as the module says, once per process; True if it is tuned now."""
    global _done
    if _done is None:
        _done = False
        if os.name == "posix" and not _user_tuned():
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
            except (OSError, AttributeError):  # not glibc: musl, macOS
                return False
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            settings = (
                (M_MMAP_MAX, 0),
                (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                (M_TOP_PAD, TOP_PAD),
            )
            _done = all([mallopt(option, value) == 1 for option, value in settings])
    return _done

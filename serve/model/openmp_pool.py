"""One OpenMP thread pool per process: the engine thread's.

Model: GNU OpenMP (torch's `libgomp`) keeps a pool of worker threads per thread that has run a
parallel region. A server loads its model on the main thread (a pool of `threads - 1` workers)
and computes on its engine thread (a second pool). With both, libgomp counts more threads than
cores and throttles its workers' spin-waiting, so every parallel region of the engine wakes its
workers through the kernel: a one-row 576 x 1536 linear took 150 us on a 2-core CPU against
70 us on a thread alone (SmolLM2 decoding one sequence: 67 against 45 ms a token).

`release_thread_pool` frees the calling thread's pool (OpenMP 5's `omp_pause_resource_all`,
soft) once it is done computing; it finds the OpenMP runtime torch loaded (GNU's, LLVM's or
Intel's) and does nothing where there is none or where it cannot pause.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1
RUNTIMES = ("libgomp", "libomp", "libiomp")


@cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime already mapped into this process (Linux: /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = sorted({ln.split()[-1] for ln in maps.splitlines() if any(r in ln for r in RUNTIMES)})
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            return lib
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP workers (they are made again if it computes again);
    True when the runtime did."""
    lib = _runtime()
    if lib is None:
        return False
    rc = lib.omp_pause_resource_all(ctypes.c_int(OMP_PAUSE_SOFT))
    if rc != 0:
        log.debug("omp_pause_resource_all returned %d", rc)
    return rc == 0

"""Malloc tuning for CPU forwards: on by default with glibc, off where the user says so or tuned
malloc already (it is process-wide, so each case runs in its own interpreter)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).parents[2] / "serve" / "model" / "host_memory.py"
LOAD = (  # the module alone: importing the serve package would load torch (seconds per case)
    "import importlib.util as u\n"
    f"s = u.spec_from_file_location('host_memory', {str(MODULE)!r})\n"
    "m = u.module_from_spec(s)\n"
    "s.loader.exec_module(m)\n"
)
PROBE = LOAD + "print(m.keep_freed_memory(), m.keep_freed_memory())"
LARGE_BLOCK = """
import ctypes
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks \
uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.mallinfo2.restype = [ctypes.c_void_p], Info
tuned = m.keep_freed_memory()
before = libc.mallinfo2().hblkhd
block = libc.malloc(128 << 20)  # a 128 MiB block: the bytes glibc maps for it
print(tuned, libc.mallinfo2().hblkhd - before)
libc.free(block)
"""


def tuned(probe: str = PROBE, **env: str) -> str:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
    }
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc tuning applies to glibc")
def test_keep_freed_memory_tunes_glibc_once() -> None:
    assert tuned() == "True True"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc tuning applies to glibc")
def test_blocks_above_glibcs_largest_mmap_threshold_come_from_the_heap_too() -> None:
    """A logits tensor of 100 MiB freed and allocated again each training step must not be
    mapped afresh (and faulted in page by page) every time: no block is mmapped once tuned."""
    assert tuned(LOAD + LARGE_BLOCK) == "True 0"
    untuned = tuned(LOAD + LARGE_BLOCK, WORKBENCH_KEEP_FREED_MEMORY="0").split()
    assert untuned[0] == "False" and int(untuned[1]) >= 128 << 20


@pytest.mark.parametrize(
    "env",
    [
        {"WORKBENCH_KEEP_FREED_MEMORY": "0"},
        {"MALLOC_MMAP_THRESHOLD_": "1048576"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"},
        {"LD_PRELOAD": "/nonexistent/libtcmalloc_minimal.so.4"},
    ],
    ids=["off-switch", "malloc-env", "glibc-tunables", "preloaded-allocator"],
)
def test_keep_freed_memory_leaves_a_user_choice_alone(env: dict[str, str]) -> None:
    assert tuned(**env) == "False False"

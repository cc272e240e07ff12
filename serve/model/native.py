"""Small C kernels of the CPU engine, compiled on first use and loaded through ctypes.

Model: a kernel source (`serve/model/kernels/*.c`) is compiled once per (source, compiler,
flags, CPU) into `$WORKBENCH_CACHE_DIR/kernels` with the C compiler `$CC` (default `cc`) and
`-march=native -fopenmp`, in about half a second. Its OpenMP runtime is the one torch already
loaded (same soname), so the kernels and torch share one pool of threads. Where no compiler
works, `build_library` returns None with the reason (`load_library`, which each kernel's loader
calls, logs it and declares the functions' signatures), and the caller keeps its torch path.
A process that will need kernels later (a recipe whose evals run the engine) may start their
builds in the background (`build_in_background`); a loader meeting a build in flight waits for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from compress.cache import cache_dir

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
LINK = ["-shared", "-fopenmp"]
NEEDS_COMPILER = "it needs a C compiler (gcc or clang as `cc`, or $CC) to build its kernel"
ROUNDED_AS_WRITTEN = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
]
"""Flags of kernels whose float results must equal torch's: no -ffast-math and no contraction of
a product and a sum into one FMA (explicit FMA intrinsics stay FMAs), so each operation rounds
where the source writes it."""


def _cpu_identity() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    return "\n".join(sorted({ln for ln in text.splitlines() if ln.startswith(wanted)}))


def _library_path(source: Path, compiler: str, flags: list[str]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True)
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what it may include
    build = [compiler, version.stdout, " ".join(flags + LINK), _cpu_identity()]
    key = "\0".join([source.read_text(), *headers, *build])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{digest}.so"


def _compile(source: Path, compiler: str, flags: list[str], target: Path) -> None:
    """Compile into a temporary file in `target`'s dir, then rename: concurrent builders each
    write their own file, and a reader never sees a half-written library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".tmp")
    os.close(fd)
    obj = f"{tmp}.o"
    try:
        for cmd in (
            [compiler, *flags, "-fPIC", "-c", "-o", obj, str(source)],
            [compiler, *LINK, "-o", tmp, obj, "-lm"],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)


_BUILDING: dict[Path, threading.Lock] = {}
_BUILDING_LOCK = threading.Lock()


def _built(source: Path, compiler: str, flags: list[str]) -> Path:
    """The library's path, compiled first where missing: one build per library at a time in
    this process, so a caller finds a background build's result instead of building it twice."""
    path = _library_path(source, compiler, flags)
    with _BUILDING_LOCK:
        lock = _BUILDING.setdefault(path, threading.Lock())
    with lock:
        if not path.exists():
            _compile(source, compiler, flags, path)
    return path


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def build_library(source: Path, flags: list[str]) -> tuple[ctypes.CDLL | None, str]:
    """The compiled library of `source` (built on first use) and "", or None and why not."""
    compiler = _compiler()
    if shutil.which(compiler) is None:
        return None, f"no C compiler {compiler!r} (set CC)"
    try:
        return ctypes.CDLL(str(_built(source, compiler, flags))), ""
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, str(e)


def build_in_background(kernels: Iterable[tuple[Path, list[str]]]) -> list[threading.Thread]:
    """Start building each (source, flags) library in a thread of its own, returning the
    threads: the compiler's first use (the engine's five kernels take about 14 s of one core)
    overlaps the caller's work. A build that fails is left for the kernel's loader, which meets
    the same error and logs it."""
    compiler = _compiler()
    if shutil.which(compiler) is None:
        return []  # the loaders say why

    def build(source: Path, flags: list[str]) -> None:
        with contextlib.suppress(OSError, RuntimeError, subprocess.SubprocessError):
            _built(source, compiler, flags)  # on failure the loader builds again and logs why

    threads = [
        threading.Thread(target=build, args=(source, flags), name=f"build {source.name}")
        for source, flags in kernels
    ]
    for thread in threads:
        thread.start()
    return threads


def load_library(
    source: Path, flags: list[str], signatures: Mapping[str, Sequence[type]], unavailable: str
) -> ctypes.CDLL | None:
    """`source`'s library (built on first use) with each function of `signatures` given its
    argument types and an int return code; None, logging `unavailable: <why>`, where it cannot
    be built (callers cache the result, so the line is logged once)."""
    lib, why_not = build_library(source, flags)
    if lib is None:
        log.warning("%s: %s", unavailable, why_not)
        return None
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = list(argtypes)
        getattr(lib, name).restype = ctypes.c_int
    return lib

"""GGUF K-quants (Q4_K_M and kin) through llama.cpp's own quantizer, where one is at hand.

Model: the `gguf` package writes only the simple block types (Q8_0, Q4_0, Q4_1); the K-quants
(super-blocks of 256 weights with quantized scales, and the per-tensor mixtures that `_M` / `_S`
name, e.g. Q4_K_M keeps half of the attention-value and feed-forward-down weights in Q6_K) are
chosen and written by llama.cpp's `llama_model_quantize`. An export asking for one writes the
variant's float GGUF first (its own float dtype; a packed variant's codes dequantized) and hands
it to that quantizer, found as (in order) the `--llama-quantize` argument,
`$WORKBENCH_LLAMA_QUANTIZE`, or `llama-quantize` on PATH: either a
`llama-quantize` executable (llama.cpp's tool: `llama-quantize IN OUT TYPE`) or a Python
interpreter with llama-cpp-python (`benchmarks/llama_cpp_check.sh` builds one in .llama-venv),
which calls the same function through its bindings. Without one, asking for a K-quant is an
error that says how to get one; nothing is written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

K_QUANTS = {
    "q2_k": 10,
    "q3_k_s": 11,
    "q3_k_m": 12,
    "q3_k_l": 13,
    "q4_k_s": 14,
    "q4_k_m": 15,
    "q5_k_s": 16,
    "q5_k_m": 17,
    "q6_k": 18,
}
"""`--gguf-type` name -> llama.cpp's `llama_ftype` (LLAMA_FTYPE_MOSTLY_*), stable since 2023."""
ENV = "WORKBENCH_LLAMA_QUANTIZE"

_BINDINGS = """\
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""
"""Run by a quantizer that is a Python: IN OUT FTYPE -> llama_model_quantize's return code."""


class QuantizerError(ValueError):
    """No usable llama.cpp quantizer, or it failed; the message says what to do."""


def find_quantizer(explicit: str | None = None) -> Path:
    """The quantizer to run: `explicit`, else $WORKBENCH_LLAMA_QUANTIZE, else `llama-quantize`
    on PATH."""
    named = explicit or os.environ.get(ENV)
    found = shutil.which(named) if named else shutil.which("llama-quantize")
    if found is None:
        where = f"{named!r} is not an executable" if named else "none was found"
        raise QuantizerError(
            f"K-quant GGUF types are written by llama.cpp's quantizer and {where}: put "
            "`llama-quantize` on PATH, or pass --llama-quantize (or set $WORKBENCH_LLAMA_QUANTIZE) "
            "to a llama-quantize binary or to a Python with llama-cpp-python "
            "(benchmarks/llama_cpp_check.sh builds one in .llama-venv)"
        )
    return Path(found)


def _is_python(quantizer: Path) -> bool:
    return quantizer.name.startswith("python")


def quantize(quantizer: Path, source: Path, target: Path, k_quant: str) -> None:
    """`source` (a float GGUF) quantized by llama.cpp into `target` as `k_quant`."""
    if _is_python(quantizer):
        cmd = [str(quantizer), "-c", _BINDINGS, str(source), str(target), str(K_QUANTS[k_quant])]
    else:
        cmd = [str(quantizer), str(source), str(target), k_quant.upper()]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not target.is_file():
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise QuantizerError(
            f"llama.cpp's quantizer ({quantizer}) failed to write {k_quant} "
            f"(exit code {done.returncode}):\n{tail}"
        )


def tensor_types(path: Path) -> dict[str, int]:
    """How many of the GGUF file's tensors are stored in each GGML type."""
    import gguf

    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return counts

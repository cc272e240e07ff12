#!/usr/bin/env bash
# Run our GGUF exports with llama.cpp (llama-cpp-python, built from source in its own venv on
# first use) and compare its perplexity, KL and top-1 agreement with the variants as the
# workbench runs them, on held-out windows of the demo corpus. A measured check, not a CI step.
#
# usage: benchmarks/llama_cpp_check.sh OUT VARIANT_DIR...
# env:   LLAMA_VENV (default .llama-venv); GGUF_TYPE: export every model variant in this GGML
#        type, e.g. q4_k_m (K-quants are written by the venv's llama-cpp-python)
set -euo pipefail
OUT=$1; shift
VENV=${LLAMA_VENV:-.llama-venv}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  python3 -m venv "$VENV"
  started=$SECONDS
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
    "$VENV/bin/pip" install -q llama-cpp-python numpy
  echo "llama-cpp-python built in $((SECONDS - started)) s"
fi
typed=()
if [ -n "${GGUF_TYPE:-}" ]; then
  typed=(--gguf-type "$GGUF_TYPE" --llama-quantize "$VENV/bin/python")
fi
.venv/bin/python -m evals.gguf_check prepare "$OUT" "$@" "${typed[@]}"
"$VENV/bin/python" benchmarks/llama_cpp_score.py "$OUT"
.venv/bin/python -m evals.gguf_check compare "$OUT"

#!/usr/bin/env bash
# The CUDA check, for a lent GPU machine (the `device` tool's nvidia-h200: PyTorch, Triton and
# pytest preinstalled, nothing downloadable there). Never part of CI.
#
#   benchmarks/gpu.sh prepare   # here, with internet: wheels the GPU image lacks -> .whl/
#   benchmarks/gpu.sh run       # there (carry .whl): gpu tests, then the per-step benchmark
#
# `run` writes everything under ${OUT:-/tmp/gpu-check}: pytest's log, step_bench's table (bf16
# engine eager and compiled vs transformers' generate) and nvidia-smi's view. About 6-8 minutes:
# the demo-tiny and 25M models are built there first (a few minutes of CPU training).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
# Packages our code imports that the image does not hold, or holds at another version. Exact
# versions are read from this checkout's .venv so both machines run the same libraries.
PACKAGES="transformers huggingface-hub hf-xet tokenizers safetensors accelerate peft pydantic
pydantic-core annotated-types typing-inspection dill platformdirs pyyaml regex tqdm rich"

prepare() {
  exclude=$(git rev-parse --git-dir)/info/exclude
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
  mkdir -p "$WHEELS"
  for name in $PACKAGES; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$WHEELS" "$name==$version"
  done
  du -sh "$WHEELS"
}

run() {
  local out=${OUT:-/tmp/gpu-check}
  mkdir -p "$out"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WORKBENCH_CACHE_DIR=/tmp/wbcache
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
  python3 -m pytest -p no:cacheprovider -m gpu -o addopts="" tests/serve/test_cuda.py -ra \
    2>&1 | tee "$out/pytest.log"
  python3 -m benchmarks.step_bench --device cuda --rounds 3 \
    --systems engine-bf16,engine-bf16-compile,generate-bf16 2>&1 | tee "$out/step_bench.txt"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac

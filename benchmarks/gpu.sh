#!/usr/bin/env bash
# The CUDA check, for a lent GPU machine (the `device` tool's nvidia-h200: PyTorch, Triton and
# pytest preinstalled, nothing downloadable there). Never part of CI.
#
#   benchmarks/gpu.sh prepare   # here, with internet: wheels the GPU image lacks -> .whl/, and
#                               # the trained demo models (their tokenizers) -> .gpucache/
#   benchmarks/gpu.sh run       # there (carry .whl .gpucache): gpu tests, then step_bench
#
# `run` writes everything under ${OUT:-/tmp/gpu-check}: pytest's log, step_bench's table (the
# engine in float32 and bf16, eager and compiled, vs transformers' generate, with each engine
# decode step's phases) and nvidia-smi's view. The models are trained here, not there: the GPU
# machine's minutes are the scarce ones. On the H200 (2026-12-04) the tests took 64 s and the
# whole run about 3.5 minutes. Knobs: BENCH=0 (tests only), SYSTEMS (step_bench's), TEST_SECONDS
# and BENCH_SECONDS (time limits). Before a run, the tests can be tried on the CPU in a venv that
# holds only the image's packages and .whl's (`cuda` rewritten to `cpu`): an import the wheel list
# lacks then fails here, not in the device minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
# Packages our code imports that the image does not hold, or holds at another version. Exact
# versions are read from this checkout's .venv so both machines run the same libraries.
PACKAGES="transformers huggingface-hub hf-xet tokenizers safetensors accelerate peft kernels tomlkit
httpx2 httpcore2 truststore idna h11 anyio pydantic pydantic-core annotated-types typing-inspection
typing-extensions typer click shellingham annotated-doc platformdirs pyyaml regex tqdm rich fastapi
starlette uvicorn opentelemetry-api"
CACHE=.gpucache

prepare() {
  exclude=$(git rev-parse --git-dir)/info/exclude
  mkdir -p "$(dirname "$exclude")"
  for path in /.whl/ /$CACHE/; do
    grep -qx "$path" "$exclude" 2>/dev/null || echo "$path" >> "$exclude"
  done
  mkdir -p "$WHEELS"
  for name in $PACKAGES; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d "$WHEELS" "$name==$version"
  done
  # bitsandbytes holds a library per CUDA version (129 MB unpacked, over the carry limit): only
  # CUDA 13's (the image's torch is cu130) and the CPU one travel, unpacked onto the path.
  version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('bitsandbytes'))")
  rm -rf "$CACHE/site" /tmp/bnb-wheel && mkdir -p "$CACHE/site"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_24_x86_64 -d /tmp/bnb-wheel "bitsandbytes==$version"
  unzip -q /tmp/bnb-wheel/bitsandbytes-*.whl -d "$CACHE/site" \
    -x 'bitsandbytes/libbitsandbytes_cuda1[12]*' 'bitsandbytes/libbitsandbytes_rocm*'
  WORKBENCH_CACHE_DIR=$CACHE .venv/bin/python -c \
    "from catalog import ensure_demo_model; ensure_demo_model('demo'); ensure_demo_model('demo-tiny')"
  du -sh "$WHEELS" "$CACHE"
}

run() {
  local out=${OUT:-/tmp/gpu-check}
  mkdir -p "$out"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl
  rm -rf /tmp/wbcache && cp -r "$CACHE" /tmp/wbcache
  export PYTHONPATH=/tmp/site:/tmp/wbcache/site:$PWD PYTHONUNBUFFERED=1 WORKBENCH_CACHE_DIR=/tmp/wbcache
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
  timeout "${TEST_SECONDS:-240}" python3 -m pytest -p no:cacheprovider -m gpu -o addopts="" \
    tests/serve/test_cuda.py tests/serve/test_flex_attention.py tests/compress/test_packed.py \
    -ra -s --durations=10 \
    2>&1 | tee "$out/pytest.log" || true
  [ "${BENCH:-1}" = 1 ] || return 0
  timeout "${BENCH_SECONDS:-180}" python3 -m benchmarks.step_bench --device cuda --rounds 3 \
    --systems "${SYSTEMS:-engine,engine-bf16,engine-bf16-compile,generate-bf16}" --phases \
    2>&1 | tee "$out/step_bench.txt"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac

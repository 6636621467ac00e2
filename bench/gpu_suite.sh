#!/usr/bin/env bash
# The GPU suite in one go on a CUDA host without internet: warm-up, GPU tests, GPU benchmarks.
# Usage: bench/gpu_suite.sh [OUT_DIR]   (default: $OUT, else ./gpu-suite-out)
# - installs the wheels carried in .whl/ (flashinfer and deps) into /tmp/site if present;
#   ../shared/gpu/fetch-wheels.sh fetches them; tests/engine/test_gpu_server.py also needs
#   the openai client there: `pip download --no-deps --only-binary=:all: --python-version 3.12
#   --platform manylinux2014_x86_64 --platform any -d .whl openai==1.109.1 distro jiter sniffio`
#   (openai 3.57 imports httpx2, which the image lacks)
#   (SUITE_INSTALL=0 skips that when the caller already did);
# - keeps FlashInfer's JIT cache in /tmp/kvtier-flashinfer-cache (outside the working tree,
#   which the device replaces each call) so a second run on the same host skips the ~90 s compile;
# - writes into OUT_DIR (at most 8 files): warmup.json, gpu_tests.txt, and per benchmark
#   NAME.json + NAME.log.
# Selection and budgets, all by environment (defaults in brackets):
#   SUITE_STAGES      stages to run, comma-separated          [warm,tests,benches]
#   WARM_PARTS        FlashInfer modules to build              [prefill,decode,sampling]
#   GPU_TESTS_K       pytest -k expression for the GPU tests   [all]
#   GPU_TESTS_FILES   test files the GPU tests come from      [tests/engine/test_gpu.py tests/engine/test_kernels.py
#                                                              tests/engine/test_decode_attention.py
#                                                              tests/engine/test_gpu_long_context.py]
#   SUITE_BENCHES     benchmarks to run, in order              [attention,engine,offload,long_context,soak,serving]
#   MODEL_DIR         HF model directory for long_context, soak and serving; written once with random
#                     Llama-3-8B-shaped weights (bench/random_model.py) when unset [/tmp/kvtier-llama-3-8b]
#   ATTENTION_BENCH_ARGS / ENGINE_BENCH_ARGS / OFFLOAD_BENCH_ARGS  extra arguments of each
#   T_WARM T_TESTS T_ATTENTION T_ENGINE T_OFFLOAD T_LONG_CONTEXT T_SOAK T_SERVING  seconds per
#                     stage (timeout), so one hang leaves time for the rest [300 600 180 900 600 300 900 580]
#   SOAK_ARGS         extra arguments of bench/soak.py (default: 300 s per mode, side by side)
#   SERVING_ARGS      arguments of bench/serving.py past its defaults (issue 18's shape: 10 users,
#                     5 rounds, 800 + 900 words, 100-token answers, 1200 GPU blocks, off/offload/
#                     lossless)                                 [--qps 0.5,1,2 --duration-s 40]
#                     (16K-token histories: --history-words 6500 --max-model-len 20480); its
#                     server logs and request logs go to /tmp/kvtier-serving, the report to OUT_DIR
#   SUITE_DEADLINE_S  whole-suite budget from its start: no stage runs past it (each stage's
#                     limit is cut to what is left, less 5 s)     [none]
# Add a benchmark: a "name|command|timeout-variable" entry in BENCHES; the command gets
# OUT_DIR in $BENCH_OUT and writes $BENCH_OUT/name.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu-suite-out}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
STAGES=",${SUITE_STAGES:-warm,tests,benches},"
START=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - START )) s] $*"; }
# limit T: T, cut to the time left before SUITE_DEADLINE_S (at least 1 s).
limit() {
  local t="$1"
  if [ -n "${SUITE_DEADLINE_S:-}" ]; then
    local left=$(( SUITE_DEADLINE_S - ($(date +%s) - START) - 5 ))
    [ "$left" -lt "$t" ] && t=$left
    [ "$t" -lt 1 ] && t=1
  fi
  echo "$t"
}

if [ "${SUITE_INSTALL:-1}" != 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# FlashInfer reads FLASHINFER_WORKSPACE_BASE (flashinfer/jit/env.py): cache = $BASE/.cache/flashinfer
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/kvtier-flashinfer-cache}"

"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
"$PY" -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' || exit 1
"$PY" -c 'import triton; print("triton", triton.__version__)' || echo "no triton: fused kernels off"

status=0
if [[ "$STAGES" == *,warm,* ]]; then
  stamp "warm FlashInfer (${WARM_PARTS:-prefill,decode,sampling})"
  timeout -k 5 "$(limit "${T_WARM:-300}")" "$PY" -m bench.engine --warm --warm-parts "${WARM_PARTS:-prefill,decode,sampling}" \
    | tee "$OUT_DIR/warmup.json" || status=1
fi

if [[ "$STAGES" == *,tests,* ]]; then
  stamp "GPU tests ${GPU_TESTS_K:+(-k $GPU_TESTS_K)}"
  kargs=()
  [ -n "${GPU_TESTS_K:-}" ] && kargs=(-k "$GPU_TESTS_K")
  # shellcheck disable=SC2086
  timeout -k 5 "$(limit "${T_TESTS:-600}")" "$PY" -m pytest -q -s -rs \
    ${GPU_TESTS_FILES:-tests/engine/test_gpu.py tests/engine/test_kernels.py tests/engine/test_decode_attention.py tests/engine/test_gpu_long_context.py} \
    -p no:cacheprovider "${kargs[@]}" 2>&1 | tee "$OUT_DIR/gpu_tests.txt" || status=1
fi

BENCHES=(
  "attention|-m bench.attention ${ATTENTION_BENCH_ARGS:-} --out \$BENCH_OUT/attention.json|T_ATTENTION"
  "engine|-m bench.engine ${ENGINE_BENCH_ARGS:-} --out \$BENCH_OUT/engine.json|T_ENGINE"
  "offload|-m bench.offload ${OFFLOAD_BENCH_ARGS:-} --out \$BENCH_OUT|T_OFFLOAD"
  "long_context|-m bench.long_context --model \$MODEL_DIR --out \$BENCH_OUT/long_context.json|T_LONG_CONTEXT"
  "soak|-m bench.soak --model \$MODEL_DIR ${SOAK_ARGS:-} --log-dir \$BENCH_OUT --out \$BENCH_OUT/soak.json|T_SOAK"
  "serving|-m bench.serving --model \$MODEL_DIR ${SERVING_ARGS:---qps 0.5,1,2 --duration-s 40} --log-dir /tmp/kvtier-serving --out \$BENCH_OUT/serving.json|T_SERVING"
)
if [[ "$STAGES" == *,benches,* ]]; then
  export BENCH_OUT="$OUT_DIR"
  export MODEL_DIR="${MODEL_DIR:-/tmp/kvtier-llama-3-8b}"
  ALL_BENCHES="attention,engine,offload,long_context,soak,serving"
  if [[ ",${SUITE_BENCHES:-$ALL_BENCHES}," == *,long_context,* || \
        ",${SUITE_BENCHES:-$ALL_BENCHES}," == *,soak,* || \
        ",${SUITE_BENCHES:-$ALL_BENCHES}," == *,serving,* ]]; then
    stamp "model directory $MODEL_DIR"
    "$PY" -m bench.random_model "$MODEL_DIR" || status=1
  fi
  for entry in "${BENCHES[@]}"; do
    IFS='|' read -r name cmd tvar <<< "$entry"
    [[ ",${SUITE_BENCHES:-$ALL_BENCHES}," == *",$name,"* ]] || continue
    declare -A defaults=([T_ATTENTION]=180 [T_ENGINE]=900 [T_OFFLOAD]=600 [T_LONG_CONTEXT]=300 [T_SOAK]=900 [T_SERVING]=580)
    lim="$(limit "${!tvar:-${defaults[$tvar]}}")"
    stamp "bench $name (limit ${lim} s)"
    # shellcheck disable=SC2086
    timeout -k 5 "$lim" "$PY" $(eval echo $cmd) 2>&1 | tee "$OUT_DIR/$name.log" || status=1
  done
fi
stamp "done, status $status"
exit $status

#!/usr/bin/env bash
# The engine-under-load and tiers-that-pay figures on one CUDA host, in stages that each fit a
# 10-minute call (bench/gpu_suite.sh runs the broad suite; this one the user-shaped runs).
# Usage: STAGES=qa,offload,lone,mixed,engine,pressure,tests bench/h200_runs.sh [OUT_DIR]   (default $OUT)
# - qa: the vLLM production-stack multi-round QA client (bench/third_party_qa.sh; its files in
#   .qa-client/, fetched for the run, git-excluded), issue 15's shape, 1200 GPU blocks, offload
#   off then on (48 GiB host tier); the client summary, the engine breakdown and the counters.
# - pressure: bench/serving.py at ~24K-token histories, a pool of 4096 blocks (under three
#   histories), qps 1, offload on (PRESSURE_MODES to add off), with the idle-ITL yardstick.
# - offload: python -m bench.offload ttft at 4K and 16K (OFFLOAD_LENGTHS) with LMDB (pipelined,
#   serial, cost, overlap) beside recompute and the host tier (TTFT_MODES); OFFLOAD_SECTIONS
#   adds sections (e.g. "pipeline,ttft"), OFFLOAD_LOGS=1 keeps each mode's request log.
# - lone: a lone host reload of a reused QA request's shape (6272 cached + 224 new tokens);
#   LONE_MODES [host] (e.g. host,host_layered); LONE_REPS repetitions [the bench's 3: on one
#   H100 they spread 20.9-33.0 ms, so take 5 or more where the median decides a line].
# - mixed: bench.profile_gpu's mixed section: a pair of such reloads while 8 requests decode,
#   the pair alone, one alone; step times, breakdowns, kernels (mixed.json), then the same
#   with at most one in-step reload a step (the sixth to eighth sessions' default:
#   mixed_onestep.json) or layer-wise in-step loads (mixed_layered.json) or coalesced loads
#   (mixed_coalesced.json); MIXED_VARIANTS="plain onestep" by default.
# - engine: python -m bench.engine --quick on the Llama-3-8B shape beside HF (no regression).
# - h2d: bench.h2d_pieces, a pair of QA reloads' copies per block (torch, driver) and layer-wise
#   by the driver (16/8/4/2 layers a copy) beside one contiguous copy (~15 s).
# - copyorder: bench.copy_order, a small upload issued after / before a 512 MiB copy on another
#   stream (~10 s).
# - lmdbprobe: bench.lmdb_first_read, the first read of freshly written LMDB values, and reads
#   split over PROBE_THREADS reader threads beside a plain memcpy (~40 s).
# - lonesweep: the lone reload at LONE_SUFFIXES new tokens [176 224] per SWEEP_MODES
#   [host,host_whole,host_coalesced], one summary line each (~40 s a suffix).
# - newshapes: bench.new_shapes, prefill steps of token counts run before and not, per
#   NEWSHAPES_VARIANTS [default,eager,warm] (~30 s a variant).
# - tests: the GPU tests of the load pipeline and the engine (pytest -m gpu on chosen files).
# QA_MODES (default "off on"; "on": a host tier of QA_HOST_CAPACITY [48GiB], whose pinning and
# release take tens of seconds: 16GiB holds the ten histories too; "small": a 2 GiB host tier over LMDB; "smallwait": small with
# --load-wait-step-tokens LOAD_WAIT_TOKENS [512]; "on256": on with
# --first-token-step-tokens 256; "lean": on with --first-token-step-others LEAN_OTHERS [64]; "fill": on with -1 (the old fill); "layered": on, with
# in-step loads landing layer by layer (LAYERS_PER_COPY [0: automatic]); "perblock": on with whole-block in-step copies (layered_loads: false, the default for raw blocks); "allinstep": on, every reload of a step in-step, the default since the ninth session; "onestep": at most one in-step load a step, the sixth to eighth sessions' default; "onestephold": that, with async copies held until the forward is queued; "coalesced": on with coalesced_loads (a run of consecutive host slots as one copy into device staging, then one scatter: a few copy commands a load instead of one a block)) and the client's TTFT by
# round (bench/qa_rounds.py, later rounds against the first mode). FI_CACHE_OUT=1 hands the
# FlashInfer and Triton JIT caches back as fi-cache.tgz; carried in as .fi-cache.tgz it skips
# the warm-up. Durations seen on one H200 (limits to set): a QA mode ~90 s past start-up with
# --time 55 (the first of a fresh machine ~60 s more: it gets T_QA_FIRST_EXTRA [90] on top of
# T_QA; a T_QA of 115 left two of three modes unfinished; with --time 60, T_QA 125 and an
# extra 50 s, off (first) and on (its 48 GiB pinned tier) were both cut at their limits and
# only small, ~105 s, finished: keep the default 240), offload ttft with 6 modes at 4K+16K
# > 280 s (at 4K alone, 5 modes: 140 s; 5 modes at 4K+16K with LMDB reads at ~0.7 GB/s did
# not reach lmdb_cost in 280 s), lone ~30 s, mixed ~45 s, engine ~45 s, pressure ~350 s (on
# 2026-12-04 a fresh machine's pressure stage ran past T_PRESSURE=420 and printed nothing:
# give it the whole call, 560; it now prints each level as it ends; on 2026-12-04, later, with
# PRESSURE_S=75 the stage took 418 s on a fresh machine, the 75 s level included: most of the
# rest is the 64 GiB pinned tier's start and release). lone needs more than 60 s on a fresh
# machine (cut at T_LONE=60 once). Three QA modes (off on lossless) with T_QA=140 and
# T_QA_FIRST_EXTRA=45: 412-468 s with the model written. A first QA mode with a
# host tier (on, small) on a fresh machine did not finish in T_QA 150 + 45 (twice): put off
# first, or give the first mode 240. On 2026-12-04 (fourteenth session) "off on onestep" with
# T_QA=140 cut `on` (its 48 GiB tier) before the client's CSV; "off on small" with T_QA=155
# finished in 432 s: two modes beside off, T_QA >= 155, or two modes with T_QA 200. Fifteenth
# session: with no JIT cache carried in, the FlashInfer warm-up took 237 s of a fresh machine
# (carry .fi-cache.tgz); with it, "off on small" at T_QA=165 plus lone ran 466 s.
# Writes a dozen files at most into OUT_DIR: summary.txt (every stage's last lines) and a JSON or log
# per stage. The device tool hands back only about 8 files a call (the rest are left out as
# "count"): pick stages so that what matters fits, e.g. QA_MODES of two modes (4 files each).
# A QA mode with a 48 GiB host tier took 200+ s with --time 75 (the server's shutdown frees
# the pinned tier): T_QA=200 cut it before its breakdown and CSV; keep T_QA at 240 there. Env: MODEL_DIR (written once, Llama-3-8B shape, random weights) [/tmp/kvtier-llama-3-8b].
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-h200-out}}"; mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null && [ ! -f /tmp/site/.kvtier ]; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && touch /tmp/site/.kvtier
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# outside the working tree: the device replaces the tree with each call's copy, so a cache
# inside it was lost between two calls on the same warm machine (~220 s of warm-up again)
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-/tmp/kvtier-flashinfer-cache}"
# Triton's JIT cache (the fused kernels) beside FlashInfer's, so fi-cache.tgz carries both: on a
# fresh machine the first server start otherwise compiles them (the first QA mode of a run ran
# past a 145-175 s limit where later modes took ~90 s).
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$FLASHINFER_WORKSPACE_BASE/.cache/triton}"
MODEL_DIR="${MODEL_DIR:-/tmp/kvtier-llama-3-8b}"
STAGES=",${STAGES:-qa},"
S="$OUT_DIR/summary.txt"
START=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - START )) s] $*" | tee -a "$S"; }
# only the served stages read a model directory (bench.offload and bench.engine build on the GPU)
if [[ "$STAGES" =~ ,(qa|pressure), ]] && [ ! -f "$MODEL_DIR/config.json" ]; then
  stamp "model"; "$PY" -m bench.random_model "$MODEL_DIR" >/dev/null
fi
if [ -f .fi-cache.tgz ] && [ ! -d "$FLASHINFER_WORKSPACE_BASE/.cache" ]; then
  mkdir -p "$FLASHINFER_WORKSPACE_BASE" && tar -xzf .fi-cache.tgz -C "$FLASHINFER_WORKSPACE_BASE"
fi
if [ ! -d "$FLASHINFER_WORKSPACE_BASE/.cache" ]; then
  stamp "warm FlashInfer"; "$PY" -m bench.engine --warm --warm-parts prefill,decode,sampling >/dev/null 2>&1
fi
# ttft_line FILE LABEL: a bench.offload report's TTFT per mode and length, in milliseconds with
# every run, as one summary line (the device may leave the JSON itself out: its file count)
ttft_line() {
  "$PY" - "$1" "$2" <<'PYEOF' 2>&1 | tee -a "$S"
import json, sys
modes = json.load(open(sys.argv[1]))["ttft"]["modes"]
parts = []
for mode, by_len in modes.items():
    for n, v in by_len.items():
        if isinstance(v, dict) and "ttft_s" in v:
            runs = ", ".join("%.1f" % (x * 1e3) for x in v["all_ttft_s"])
            parts.append("%s %s: %.1f (runs %s)" % (mode, n, v["ttft_s"] * 1e3, runs))
print(sys.argv[2] + ": " + "; ".join(parts))
PYEOF
}
if [[ "$STAGES" == *,copyorder,* ]]; then
  # does a small upload wait behind a large copy issued before it on another stream?
  stamp "copy order"
  timeout -k 5 60 "$PY" -m bench.copy_order > "$OUT_DIR/copy_order.json" 2>&1
  tail -n 1 "$OUT_DIR/copy_order.json" | tee -a "$S"
fi
if [[ "$STAGES" == *,h2d,* ]]; then
  # a pair of QA reloads' copies issued per block (torch, driver) and a group of layers at a time
  stamp "h2d pieces"
  timeout -k 5 60 "$PY" -m bench.h2d_pieces > "$OUT_DIR/h2d_pieces.json" 2>&1
  tail -n 1 "$OUT_DIR/h2d_pieces.json" | tee -a "$S"
fi
if [[ "$STAGES" == *,lmdbprobe,* ]]; then
  # the first read of freshly written LMDB values against warm and plain reads (issue 28)
  stamp "lmdb first read"
  timeout -k 5 "${T_PROBE:-90}" "$PY" -m bench.lmdb_first_read --dir "${PROBE_DIR:-/tmp}" \
    --threads "${PROBE_THREADS:-1,2,4,8}" > "$OUT_DIR/lmdb_first_read.log" 2>&1
  tail -n 1 "$OUT_DIR/lmdb_first_read.log" | tee -a "$S"
fi
if [[ "$STAGES" == *,qa,* ]]; then
  runs=(); logs=()
  # off first when asked for: a host-tier mode as the first of a fresh machine (compiles, JIT
  # caches, a pinned tier) did not finish within T_QA + T_QA_FIRST_EXTRA twice
  qa_modes=$(for m in ${QA_MODES:-off on}; do echo "$m"; done | awk '$0=="off"{print; next} {rest=rest" "$0} END{print rest}' | xargs)
  for mode in $qa_modes; do
    # QA_PYSPY_MODES: the modes py-spy samples (QA_PYSPY_S seconds each, third_party_qa.sh)
    spy_s=""; [[ " ${QA_PYSPY_MODES:-} " == *" $mode "* ]] && spy_s=${QA_PYSPY_S:-40}
    flags=(--num-gpu-blocks 1200 --first-token-step-tokens "${FIRST_TOKEN_STEP_TOKENS:-512}")
    # suffixes of a mode name, in any order (onwarm, offcold, oneager): that mode with
    # --gemm-warmup (warm), --no-gemm-warmup (cold), or CUDA_MODULE_LOADING=EAGER for the server
    # (eager: every kernel loaded when CUDA starts, none on a step's first launch of it)
    base=$mode; qa_env=()
    while :; do
      case "$base" in
        ?*warm) base=${base%warm}; flags+=(--gemm-warmup) ;;
        ?*cold) base=${base%cold}; flags+=(--no-gemm-warmup) ;;
        ?*eager) base=${base%eager}; qa_env=(CUDA_MODULE_LOADING=EAGER) ;;
        *) break ;;
      esac
    done
    case "$base" in
      on|on256|lean|fill) printf 'tiers:\n  - {kind: host, capacity: %s}\n' "${QA_HOST_CAPACITY:-48GiB}" > "/tmp/qa_$mode.yaml"
        if [ "$base" = on256 ]; then flags=(--num-gpu-blocks 1200 --first-token-step-tokens 256); fi
        if [ "$base" = lean ]; then flags+=(--first-token-step-others "${LEAN_OTHERS:-64}"); fi
        if [ "$base" = fill ]; then flags+=(--first-token-step-others -1); fi ;;
      layered) printf 'layered_loads: true\nlayers_per_copy: %s\ntiers:\n  - {kind: host, capacity: 48GiB}\n' "${LAYERS_PER_COPY:-0}" > /tmp/qa_layered.yaml ;;
      perblock) printf 'layered_loads: false\ntiers:\n  - {kind: host, capacity: 48GiB}\n' > /tmp/qa_perblock.yaml ;;
      allinstep) printf 'in_step_loads_per_step: 0\ntiers:\n  - {kind: host, capacity: 48GiB}\n' > /tmp/qa_allinstep.yaml ;;
      onestep) printf 'in_step_loads_per_step: 1\ntiers:\n  - {kind: host, capacity: 48GiB}\n' > /tmp/qa_onestep.yaml ;;
      onestephold) printf 'in_step_loads_per_step: 1\nasync_copies_after_forward: true\ntiers:\n  - {kind: host, capacity: 48GiB}\n' > /tmp/qa_onestephold.yaml ;;
      lossless) printf 'compression: lossless\ntiers:\n  - {kind: host, capacity: 48GiB}\n' > /tmp/qa_lossless.yaml ;;
      ahead) printf 'load_issue_ahead: %s\ntiers:\n  - {kind: host, capacity: %s}\n' "${ISSUE_AHEAD:-4}" "${QA_HOST_CAPACITY:-48GiB}" > "/tmp/qa_$mode.yaml" ;;
      coalesced) printf "coalesced_loads: true\ntiers:\n  - {kind: host, capacity: %s}\n" "${QA_HOST_CAPACITY:-48GiB}" > /tmp/qa_coalesced.yaml ;;
      small|smallwait|smallwm) rm -rf /tmp/qa_lmdb  # issue 28's shape: a 2 GiB host tier over LMDB
        # smallwm: LMDB writing through its map (writemap, the default until the 21st session)
        wm=false; [ "$base" = smallwm ] && wm=true
        printf 'tiers:\n  - {kind: host, capacity: 2GiB}\n  - {kind: lmdb, path: /tmp/qa_lmdb, capacity: 64GiB, writemap: %s}\n' "$wm" > "/tmp/qa_$mode.yaml"
        # smallwait: steps stay short while a request waits for its LMDB load (docs/scheduling.md)
        if [ "$base" = smallwait ]; then flags+=(--load-wait-step-tokens "${LOAD_WAIT_TOKENS:-512}"); fi ;;
    esac
    [ "$base" != off ] && flags+=(--kv-offload --kv-offload-config "/tmp/qa_$mode.yaml")
    stamp "qa $mode"
    # The first server start of a machine compiles and reads what later ones find cached.
    limit=$(( ${T_QA:-240} + (${#runs[@]} == 0 ? ${T_QA_FIRST_EXTRA:-90} : 0) ))
    env "${qa_env[@]}" QA_PYSPY_S=$spy_s PYTHON="$PY" timeout -k 5 "$limit" bench/third_party_qa.sh .qa-client "$MODEL_DIR" "/tmp/qa_$mode" "${flags[@]}" \
      2>&1 | tee -a "$S"
    # the API side of the client's TTFT (template, tokenize, core -> first chunk): sums, counts
    grep -E '^kvtier_request_ttft_phase_seconds_(sum|count)\{.*phase="(api_template|api_tokenize|return|first_text|to_core)"' \
      "/tmp/qa_$mode.metrics.txt" 2>/dev/null | sed 's/model_name="qa",//' | tr '\n' ' ' | tee -a "$S"; echo | tee -a "$S"
    # the steps around each reused request's first token (its logs are in qa_files.tgz)
    "$PY" -m bench.step_context "/tmp/qa_$mode.requests.jsonl" "/tmp/qa_$mode.steps.jsonl" 2>/dev/null \
      | tail -n 1 | tee -a "$S"
    cp "/tmp/qa_$mode.breakdown.json" "$OUT_DIR/qa_${mode}_breakdown.json" 2>/dev/null
    cp "/tmp/qa_$mode.requests.jsonl" "$OUT_DIR/qa_${mode}_requests.jsonl" 2>/dev/null
    cp "/tmp/qa_$mode.requests.api.jsonl" "$OUT_DIR/qa_${mode}_requests_api.jsonl" 2>/dev/null
    cp "/tmp/qa_$mode.steps.jsonl" "$OUT_DIR/qa_${mode}_steps.jsonl" 2>/dev/null
    cp "/tmp/qa_$mode.csv" "$OUT_DIR/qa_${mode}.csv" 2>/dev/null
    cp "/tmp/qa_$mode.pyspy.txt" "$OUT_DIR/qa_${mode}_pyspy.txt" 2>/dev/null
    # the whole /metrics and the server's warnings (a tier's failures, queue drops) for the tarball
    cp "/tmp/qa_$mode.metrics.txt" "$OUT_DIR/qa_${mode}_metrics.txt" 2>/dev/null
    grep -E "WARNING|ERROR|Traceback" "/tmp/qa_$mode.server.log" 2>/dev/null | grep -v '"POST /v1/' | head -n 200 \
      > "$OUT_DIR/qa_${mode}_warnings.txt"
    tail -n 2 "/tmp/qa_$mode.pyspy.log" 2>/dev/null | tee -a "$S"
    runs+=("$mode=/tmp/qa_$mode.csv"); logs+=(--request-log "$mode=/tmp/qa_$mode.requests.jsonl")
  done
  "$PY" -m bench.qa_rounds "${runs[@]}" "${logs[@]}" --out "$OUT_DIR/qa_rounds.json" | tail -n 1 | tee -a "$S"
  # QA_TAR=1: the client CSVs and request logs as one file (the device hands back ~8 files)
  if [ -n "${QA_TAR:-}" ]; then
    tar -czf "$OUT_DIR/qa_files.tgz" -C "$OUT_DIR" $(cd "$OUT_DIR" && ls qa_*.csv qa_*_requests.jsonl qa_*_requests_api.jsonl qa_*_steps.jsonl qa_*_pyspy.txt qa_*_metrics.txt qa_*_warnings.txt 2>/dev/null) \
      && rm -f "$OUT_DIR"/qa_*.csv "$OUT_DIR"/qa_*_requests.jsonl "$OUT_DIR"/qa_*_requests_api.jsonl "$OUT_DIR"/qa_*_steps.jsonl "$OUT_DIR"/qa_*_breakdown.json "$OUT_DIR"/qa_*_pyspy.txt \
        "$OUT_DIR"/qa_*_metrics.txt "$OUT_DIR"/qa_*_warnings.txt
  fi
fi
if [[ "$STAGES" == *,offload,* ]]; then
  stamp "offload ttft"
  # the QA stage's LMDB (up to 64 GiB in `small`) beside the 16 GB model filled the 64 GiB
  # disk before bench.offload's own LMDB (twenty-fifth session: "No space left on device")
  rm -rf /tmp/qa_lmdb
  # --interleave: the modes' engines alive at once, taking turns each repetition (the same
  # plan measured in two modes differed by 15% when run one mode after the other)
  timeout -k 5 "${T_OFFLOAD:-400}" "$PY" -m bench.offload --sections "${OFFLOAD_SECTIONS:-ttft}" --interleave \
    --lengths "${OFFLOAD_LENGTHS:-4096,16384}" ${OFFLOAD_LOGS:+--request-log-dir "$OUT_DIR"} \
    --ttft-modes "${TTFT_MODES:-host,lmdb,lmdb_serial,lmdb_overlap,lmdb_cost}" \
    --lmdb-max-len 16384 ${OFFLOAD_REPS:+--reps "$OFFLOAD_REPS"} --out "$OUT_DIR" > "$OUT_DIR/offload.log" 2>&1
  tail -n 1 "$OUT_DIR/offload.log" | tee -a "$S"
fi
if [[ "$STAGES" == *,lonesweep,* ]]; then
  # The lone reload of a QA turn's shape at several new-token counts (LONE_SUFFIXES) and host
  # paths (SWEEP_MODES): in the twenty-fifth session's QA run reused steps with 173-223 new
  # tokens blocked 10-18 ms in the forward's launches where 232-252 did not.
  for suffix in ${LONE_SUFFIXES:-176 224}; do
    stamp "lone sweep: suffix $suffix"
    rm -rf "/tmp/lonesweep_$suffix"
    timeout -k 5 "${T_LONESWEEP:-120}" "$PY" -m bench.offload --sections ttft --interleave \
      --ttft-modes "${SWEEP_MODES:-host,host_whole,host_coalesced}" --lengths "${LONE_LENGTH:-6272}" \
      --suffix-tokens "$suffix" --reps "${LONE_REPS:-5}" --out "/tmp/lonesweep_$suffix" > "/tmp/lonesweep_$suffix.log" 2>&1
    ttft_line "/tmp/lonesweep_$suffix/offload.json" "lone sweep, $suffix new tokens, TTFT ms"
  done
fi
if [[ "$STAGES" == *,newshapes,* ]]; then
  stamp "new shapes (${NEWSHAPES_VARIANTS:-default,eager,warm})"
  timeout -k 5 "${T_NEWSHAPES:-300}" "$PY" -m bench.new_shapes --variants "${NEWSHAPES_VARIANTS:-default,eager,warm}" \
    --out "$OUT_DIR/new_shapes.json" > /tmp/new_shapes.log 2>&1
  tail -n 1 /tmp/new_shapes.log | tee -a "$S"
fi
if [[ "$STAGES" == *,lone,* ]]; then
  # A lone host reload of a reused QA request's shape (~6.3K cached, ~230 computed): the
  # yardstick of the QA run's engine-side TTFT of reused requests.
  stamp "lone reload (QA shape)"
  mkdir -p "$OUT_DIR/lone"
  timeout -k 5 "${T_LONE:-150}" "$PY" -m bench.offload --sections ttft --ttft-modes "${LONE_MODES:-host}" \
    --lengths "${LONE_LENGTH:-6272}" --suffix-tokens "${LONE_SUFFIX:-224}" --out "$OUT_DIR/lone" \
    ${LONE_REPS:+--reps "$LONE_REPS"} > /tmp/lone.log 2>&1
  tail -n 1 /tmp/lone.log | tee -a "$S"
  ttft_line "$OUT_DIR/lone/offload.json" "lone TTFT ms"
fi
if [[ "$STAGES" == *,mixed,* ]]; then
  # the QA run's reused step reproduced offline: a pair of host reloads of the lone shape
  # arriving while 8 requests decode, then the pair alone, then one alone (bench.profile_gpu)
  for variant in ${MIXED_VARIANTS:-plain onestep}; do
    stamp "mixed step (QA shape, $variant)"
    flag=(); name=mixed
    case "$variant" in
      layered) flag=(--layered); name=mixed_layered ;;
      allinstep) flag=(--in-step-loads-per-step 0); name=mixed_allinstep ;;  # the default
      onestep) flag=(--in-step-loads-per-step 1); name=mixed_onestep ;;
      coalesced) flag=(--coalesced); name=mixed_coalesced ;;  # runs of host slots whole
      ahead) flag=(--issue-ahead "${ISSUE_AHEAD:-4}"); name=mixed_ahead ;;  # load_issue_ahead
      kernel) flag=(--layer-path kernel); name=mixed_kernel ;;  # the Triton copy kernel
      driver) flag=(--layer-path driver); name=mixed_driver ;;  # a driver copy per block
    esac
    timeout -k 5 "${T_MIXED:-150}" "$PY" -m bench.profile_gpu --sections mixed "${flag[@]}" \
      --length "${LONE_LENGTH:-6272}" --suffix "${LONE_SUFFIX:-224}" --out "$OUT_DIR/$name.json" \
      > /tmp/mixed.log 2>&1
    tail -n 1 /tmp/mixed.log | tee -a "$S"
  done
fi
if [[ "$STAGES" == *,engine,* ]]; then
  # the engine against HF transformers on the same weights (no-regression yardstick)
  stamp "bench.engine (quick, Llama-3-8B shape)"
  timeout -k 5 "${T_ENGINE:-200}" "$PY" -m bench.engine --quick --models llama3-8b \
    --variants "${ENGINE_VARIANTS:-fused}" --out "$OUT_DIR/engine.json" > /tmp/engine.log 2>&1
  tail -n 1 /tmp/engine.log | tee -a "$S"
fi
if [[ "$STAGES" == *,pressure,* ]]; then
  stamp "pressure (${PRESSURE_MODES:-offload})"
  T_P="${T_PRESSURE:-560}"
  rm -rf /tmp/kvtier-pressure; : > "$OUT_DIR/pressure.log"
  timeout -k 5 "$T_P" "$PY" -m bench.serving --model "$MODEL_DIR" --modes "${PRESSURE_MODES:-offload}" \
    --users 8 --rounds 5 --system-words 200 --history-words 10200 --question-words 20 --answer-len 100 \
    --num-gpu-blocks 4096 --max-model-len 32768 --host-capacity "${PRESSURE_HOST:-64GiB}" --qps 1 \
    --duration-s "${PRESSURE_S:-90}" --quiet-batch 2 --log-dir /tmp/kvtier-pressure \
    --out "$OUT_DIR/pressure.json" >> "$OUT_DIR/pressure.log" 2>&1 &  # appends: beside the lines below
  ppid=$!
  # progress every 30 s (requests the servers logged), and 30 s before the limit every thread's
  # stack of each server and engine core (SIGUSR1, faulthandler) into the servers' logs
  t0=$(date +%s); dumped=""
  while kill -0 "$ppid" 2>/dev/null; do
    sleep 5
    el=$(( $(date +%s) - t0 ))
    if (( el % 30 < 5 )); then
      echo "pressure: [$el s] $(cat /tmp/kvtier-pressure/*.requests.jsonl 2>/dev/null | wc -l) requests logged" >> "$OUT_DIR/pressure.log"
    fi
    if [ -z "$dumped" ] && (( el >= T_P - 30 )); then
      dumped=1
      for pid in $(pgrep -f "engine.cli serve") $(pgrep -f spawn_main | while read -r c; do
          grep -q resource_tracker /proc/"$c"/cmdline 2>/dev/null || echo "$c"; done); do
        kill -USR1 "$pid" 2>/dev/null
      done
      echo "pressure: [$el s] stacks dumped into the server logs" >> "$OUT_DIR/pressure.log"
    fi
  done
  wait "$ppid"; rc=$?
  grep -E '^serving: ' "$OUT_DIR/pressure.log" | tail -n 6 | tee -a "$S"
  if [ "$rc" != 0 ]; then  # cut at its limit: what the server got through, and where it stood
    echo "pressure: rc $rc; $(cat /tmp/kvtier-pressure/*.requests.jsonl 2>/dev/null | wc -l) requests logged" | tee -a "$S"
    grep -E '^pressure: \[' "$OUT_DIR/pressure.log" | tail -n 20 | tee -a "$S"
    for f in /tmp/kvtier-pressure/serving_*.log; do
      grep -v '"POST /v1/' "$f" | tail -n 400 > "$OUT_DIR/pressure_$(basename "$f")"
    done
    for f in /tmp/kvtier-pressure/*.requests.jsonl; do gzip -c "$f" > "$OUT_DIR/$(basename "$f").gz"; done
    pkill -9 -f "engine.cli serve"  # the bench was killed: its servers are orphans now
  fi
fi
if [[ "$STAGES" == *,tests,* ]]; then
  stamp "gpu tests"
  timeout -k 5 "${T_TESTS:-300}" "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu \
    ${GPU_TEST_FILES:-tests/connectors/offload/test_pipeline.py tests/connectors/offload/test_in_step.py tests/connectors/device/test_copy.py tests/engine/test_gpu.py} \
    > "$OUT_DIR/gpu_tests.txt" 2>&1
  tail -n 5 "$OUT_DIR/gpu_tests.txt" | tee -a "$S"
fi
if [ -n "${FI_CACHE_OUT:-}" ] && [ -d "$FLASHINFER_WORKSPACE_BASE/.cache" ]; then
  tar -czf "$OUT_DIR/fi-cache.tgz" -C "$FLASHINFER_WORKSPACE_BASE" .cache
  stamp "FlashInfer cache $(du -h "$OUT_DIR/fi-cache.tgz" | cut -f1)"
fi
stamp "done"

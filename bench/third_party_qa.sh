#!/usr/bin/env bash
# The vLLM production-stack multi-round QA client against `kvtier serve`, as a user runs it.
# The client is NOT part of this repository: fetch benchmarks/multi-round-qa/{multi-round-qa.py,utils.py}
# from github.com/vllm-project/production-stack into CLIENT_DIR (it needs openai and pandas).
# Usage: bench/third_party_qa.sh CLIENT_DIR MODEL_DIR OUT_PREFIX [kvtier serve flags...]
# Env: QA_ARGS (client flags; default the long-context issue's shape), PORT (default: free).
# Writes OUT_PREFIX.server.log, OUT_PREFIX.client.log, OUT_PREFIX.csv, OUT_PREFIX.requests.jsonl (the
# engine's request log; OUT_PREFIX.requests.api.jsonl: the API's return and first-text times; OUT_PREFIX.steps.jsonl: the engine's step log), OUT_PREFIX.breakdown.json (bench/ttft_breakdown.py) and OUT_PREFIX.metrics.txt
# (the server's /metrics at the end); prints the client's summary, the engine-side TTFT breakdown of
# reused and fresh requests, the scheduler's and lookups' counters, and a last line
# "third_party_qa: N responses by status {...}, health H" from the server's access log.
set -uo pipefail
client=$1 model=$2 out=$3; shift 3
PY="${PYTHON:-python3}"
case "$PY" in */*) [[ "$PY" = /* ]] || PY="$PWD/$PY" ;; esac  # the client runs from its own folder
port=${PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
qa_args=${QA_ARGS:---num-users 10 --shared-system-prompt 1000 --user-history-prompt 2000 --answer-len 100 --num-rounds 5 --qps 1 --time 90}
rm -f "$out.requests.jsonl" "$out.requests.api.jsonl" "$out.steps.jsonl"  # appended to by the server
"$PY" -m engine.cli serve --model "$model" --port "$port" --served-model-name qa --log-level info \
  --request-log "$out.requests.jsonl" --step-log "$out.steps.jsonl" "$@" >"$out.server.log" 2>&1 &
server=$!
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || { echo "third_party_qa: server exited during start-up"; tail -20 "$out.server.log"; exit 1; }
  sleep 1
done
# QA_PYSPY_S=N: py-spy (carried in as a wheel; /tmp/site/bin) samples the server and its
# subprocesses for N seconds, every thread, idle ones too, without pausing them (raw stacks in
# OUT_PREFIX.pyspy.txt): where the engine's threads spend a run.
spy=$(command -v py-spy || ls /tmp/site/bin/py-spy 2>/dev/null)
if [ -n "${QA_PYSPY_S:-}" ] && [ -n "$spy" ]; then
  (sleep "${QA_PYSPY_DELAY_S:-10}"; "$spy" record --pid $server --subprocesses --threads --idle --nonblocking \
    --rate 200 --format raw --duration "$QA_PYSPY_S" -o "$out.pyspy.txt" >"$out.pyspy.log" 2>&1) &
fi
# shellcheck disable=SC2086
(cd "$client" && "$PY" multi-round-qa.py $qa_args --model qa --base-url "http://127.0.0.1:$port/v1" \
  --output "$out.csv") >"$out.client.log" 2>&1
client_rc=$?
health=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health")
curl -s "http://127.0.0.1:$port/metrics" >"$out.metrics.txt"
kill -INT $server; wait $server; server_rc=$?
sed -n '/Performance summary/,/=====$/p' "$out.client.log" | sed 's/\x1b\[[0-9;]*m//g' | grep -v '^$'
"$PY" -m bench.ttft_breakdown "$out.requests.jsonl" --out "$out.breakdown.json" | tail -n 1
grep -E '^kvtier_(scheduler_[a-z_]+|kv_lookup[a-z_]*|kv_loaded_blocks|num_preemptions|kv_prefetch[a-z_]*)_total[{ ]' \
  "$out.metrics.txt" | tr '\n' ' '; echo
# Per tier: what it held and served, what it evicted, what reached the tier below, and the
# cost model's read-rate estimate (why a held prefix was recomputed).
grep -E '^kvtier_kv_(tier_(hits|evictions|demoted|demotions_dropped|written_back|inflight_hits|written_through|write_queue_dropped|write_present|placement_skipped|resave_bypassed)_total|cost_model_tier_bandwidth_bytes_per_second|cost_model_outcome_ratio|recomputed_tokens_total|loaded_tokens_total|saved_blocks_total|save_skipped_blocks_total|decisions_total|shared_step_outcomes_total|backlog_decisions_total)[{ ]' \
  "$out.metrics.txt" | sed 's/model_name="qa",\?//' | tr '\n' ' '; echo
if [ "$server_rc" != 0 ] || [ "$health" != 200 ]; then  # why the server went down
  echo "third_party_qa: server log (last lines but requests):"
  grep -v '"POST /v1/' "$out.server.log" | tail -n 25
fi
grep -h "other threads' CPU seconds" "$out.server.log" | tail -n 1 | sed 's/.*other threads/other threads/'
statuses=$(grep -o '"POST /v1/chat/completions HTTP/1.1" [0-9]*' "$out.server.log" | awk '{print $NF}' | sort | uniq -c | awk '{printf "%s%s:%s", (NR>1?", ":""), $2, $1}')
echo "third_party_qa: responses by status {$statuses}, health $health, client rc $client_rc, server rc $server_rc"

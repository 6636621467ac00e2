#!/usr/bin/env bash
# The GPU suite in one go on a CUDA host without internet: GPU tests, then GPU benchmarks.
# Usage: bench/gpu_suite.sh [OUT_DIR]   (default: $OUT, else ./gpu-suite-out)
# - installs the wheels carried in .whl/ (flashinfer and deps) into /tmp/site if present;
# - keeps FlashInfer's JIT cache inside the repo (.flashinfer-cache/, git-excluded) so a
#   second run on the same host skips the ~80 s compile;
# - writes gpu_tests.txt, warmup.json and one JSON per benchmark into OUT_DIR.
# Add a benchmark by appending "name|command" to BENCHES (its JSON goes to $OUT_DIR/name.json).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu-suite-out}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# FlashInfer reads FLASHINFER_WORKSPACE_BASE (flashinfer/jit/env.py): cache = $BASE/.cache/flashinfer
export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-$PWD/.flashinfer-cache}"
if [ -d .git ] && ! grep -qx '/.flashinfer-cache/' .git/info/exclude 2>/dev/null; then
  echo '/.flashinfer-cache/' >> .git/info/exclude
fi

"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
"$PY" -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' || exit 1

status=0
echo "== warm FlashInfer"
"$PY" -m bench.engine --warm | tee "$OUT_DIR/warmup.json" || status=1

echo "== GPU tests"
"$PY" -m pytest -q -m gpu -s tests/engine/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT_DIR/gpu_tests.txt" || status=1

BENCHES=(
  "engine|-m bench.engine ${ENGINE_BENCH_ARGS:-}"
)
for entry in "${BENCHES[@]}"; do
  name="${entry%%|*}"
  cmd="${entry#*|}"
  echo "== bench $name"
  # shellcheck disable=SC2086
  "$PY" $cmd --out "$OUT_DIR/$name.json" || status=1
done
exit $status

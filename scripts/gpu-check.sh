#!/usr/bin/env bash
# The CUDA paths in one prepared run (< 8 minutes on one GPU): every test marked `gpu` (pinned
# memory, streams, non-blocking copies, the T1 path, the model on the device, the decode step
# captured in CUDA graphs vs uncaptured), then `kvfleet bench replica --device cuda` (its decode
# rows carry the graphs' speedup over the uncaptured step), all into one log. Record the
# figures in docs/benchmarks.md with the date and the device.
#
#   scripts/gpu-check.sh [--dry-run] [--log FILE] [--bench-args "ARGS"]
#
# --dry-run prints the plan and the selected tests without needing CUDA (or running anything);
# the test selection is the `gpu` marker, so a new CUDA test joins by carrying the marker
# (tests/lab/engine/test_gpu_check.py checks that every CUDA-guarded test does).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

DRY_RUN=0
LOG="gpu-check-$(date -u +%Y%m%dT%H%M%SZ).log"
BENCH_ARGS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --log) LOG="${2:?--log needs a file}"; shift ;;
        --bench-args) BENCH_ARGS="${2?--bench-args needs a value}"; shift ;;
        -h|--help) sed -n 2,12p "$0"; exit 0 ;;
        *) echo "gpu-check: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
    shift
done

TESTS_CMD=(pytest -m gpu -v -p no:cacheprovider --timeout 300 tests)
BENCH_CMD=(kvfleet bench replica --device cuda)
# shellcheck disable=SC2206  # word splitting of the extra bench options is the point
BENCH_CMD+=($BENCH_ARGS)

exec > >(tee -a "$LOG") 2>&1
echo "== gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $ROOT, log $LOG"

source scripts/env.sh
if [ "$DRY_RUN" = 0 ] && [ ! -x "$KVFLEET_VENV/bin/python" ]; then
    echo "== make setup (no environment at $KVFLEET_VENV yet)"
    make setup
fi
export PATH="$KVFLEET_VENV/bin:$PATH"

if [ "$DRY_RUN" = 1 ]; then
    echo "== plan"
    echo "tests: ${TESTS_CMD[*]}"
    echo "bench: timeout 420 ${BENCH_CMD[*]}"
    echo "== selected tests"
    pytest -m gpu --collect-only -q -p no:cacheprovider tests | grep '::' || {
        echo "gpu-check: no test carries the gpu marker" >&2; exit 1; }
    exit 0
fi

nvidia-smi || true
python -c 'import torch, sys
ok = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if ok else "")
sys.exit(0 if ok else "gpu-check: CUDA is not available to torch here")'

status=0
start=$SECONDS
echo "== CUDA-guarded tests: ${TESTS_CMD[*]}"
"${TESTS_CMD[@]}" || status=1
echo "== tests took $((SECONDS - start)) s"
start=$SECONDS
echo "== replica bench: ${BENCH_CMD[*]}"
timeout 420 "${BENCH_CMD[@]}" || status=1
echo "== bench took $((SECONDS - start)) s; exit $status; log $LOG"
exit "$status"

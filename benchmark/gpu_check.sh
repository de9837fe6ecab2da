#!/usr/bin/env bash
# One-shot check of GRAFT's GPU pieces on one machine with torch, triton (and nvcc); no SGLang,
# no network. Under 7 minutes on one H200 (the limits below add up to 405 s); results in DIR:
# gpu_check.json, gpu_timings.json, and the logs gpu_check.log, tree_tests.log (+ tree_tests.xml).
#
#   bash benchmark/gpu_check.sh --out DIR                                # CUDA
#   TRITON_INTERPRET=1 bash benchmark/gpu_check.sh --interpret --out DIR  # CPU, Triton interpreter
#
# CUDA: 1. the tree-core tests with their CUDA variants, and test/test_graphs.py: the draft + tree
# step captured as CUDA graphs (a toy draft; topk 4, 6 steps, N 1/4/8/16 at bs 1 and 16) and the
# served tree build through engine.tree_graph, replay == eager (pytest, if installed);
# 2. benchmark/gpu_check.py: every Triton kernel vs its torch reference on generated cases (up to
# ~2,000 each, a minute each at most), torch.cuda.set_sync_debug_mode("error") over the eager and
# captured tree step, graph replay == eager; 1 and 2 side by side; then timings at bs 1 / 16 / 64
# and N 16 / 61.
# --interpret: the kernel checks only, small cases, on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-$(command -v python || command -v python3)}"
OUT_DIR="${OUT:-benchmark/out}"
INTERPRET=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR="$2"; shift 2 ;;
        --interpret) INTERPRET=1; shift ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --out DIR [--interpret])" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT_DIR"
export SGLANG_GRAFT_STANDALONE=1
export PYTHONPATH="python:kernels${PYTHONPATH:+:$PYTHONPATH}"

if [ "$INTERPRET" = 1 ]; then
    if [ "${TRITON_INTERPRET:-}" != 1 ]; then
        echo "gpu_check.sh --interpret needs TRITON_INTERPRET=1" >&2; exit 2
    fi
    exec timeout 300 "$PY" benchmark/gpu_check.py --interpret --out "$OUT_DIR"
fi

"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device visible to torch"; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")'
"$PY" -c 'import triton; print("triton", triton.__version__)'

# The tests and the kernel checks run side by side (one GPU, many cores); the timings after both.
status=0
if "$PY" -c 'import pytest, hypothesis' 2>/dev/null; then
    echo "== tree-core tests (CPU and CUDA variants), graph capture: $OUT_DIR/tree_tests.log =="
    # test_graphs.py first; the hypothesis tests' CUDA variants compile graft_step for every new shape
    # (2-3 s each on an H200), so the whole set took more than 240 s beside the checks there
    timeout 330 "$PY" -m pytest test/test_graphs.py test/test_tree_*.py -q -p no:cacheprovider -rs \
        -o faulthandler_timeout=90 --durations=12 --junitxml="$OUT_DIR/tree_tests.xml" \
        > "$OUT_DIR/tree_tests.log" 2>&1 &
    tests=$!
else
    echo "== pytest / hypothesis missing: tree-core tests skipped ==" | tee "$OUT_DIR/tree_tests.log"
    tests=
fi

echo "== kernels vs references, sync debug, graph replay =="
GPU_CHECK_TRACEBACK_AFTER=230 timeout 240 "$PY" benchmark/gpu_check.py --phase checks --case-seconds 50 \
    --out "$OUT_DIR" \
    > "$OUT_DIR/gpu_check.log" 2>&1 || status=1
tail -c 3000 "$OUT_DIR/gpu_check.log"
if [ -n "$tests" ]; then
    wait "$tests" || status=1
    tail -n 40 "$OUT_DIR/tree_tests.log"
fi

echo "== timings =="
GPU_CHECK_TRACEBACK_AFTER=65 timeout 75 "$PY" benchmark/gpu_check.py --phase timings --out "$OUT_DIR" || status=1
exit $status

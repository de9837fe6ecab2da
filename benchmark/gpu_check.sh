#!/usr/bin/env bash
# GPU check of the GRAFT tree core (prune -> graft -> flatten, reference verifiers).
#
# Needs only a CUDA build of torch (+ triton, pytest, hypothesis); SGLang is not required.
# 1. runs the tree-core tests, including their CUDA variants (marked `gpu`) and the CUDA-graph
#    capture/replay test;
# 2. captures prune + graft + flatten in a CUDA graph and times eager vs replay at bs 1/16/64,
#    N = 60, printing a table (JSON + PNG under $OUT or benchmark/out).
# Finishes in a few minutes; each stage has its own timeout.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python}"
OUT_DIR="${OUT:-benchmark/out}"
export SGLANG_GRAFT_STANDALONE=1
export PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'PYCHECK'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PYCHECK

echo "== tree-core tests (CPU and CUDA variants) =="
timeout 300 "$PY" -m pytest test/test_tree_*.py -q -p no:cacheprovider -rs

echo "== prune + graft + flatten timing (eager and CUDA graph replay) =="
mkdir -p "$OUT_DIR"
timeout 150 "$PY" benchmark/tree_bench.py --device cuda --cuda-graph --bs 1 16 64 --num-nodes 60 \
    --out-dir "$OUT_DIR"

#!/usr/bin/env bash
# GRAFT served by SGLang on one GPU (benchmark/gpu_serve_check.py has what it checks): one command,
# under 8 minutes, results in DIR (gpu_serve.json, one log per server).
#
#   bash scripts/gpu_bundle.sh                               # here, with a package index: build .gpubundle/
#   bash benchmark/gpu_serve_check.sh --out DIR              # on the GPU machine, .gpubundle/ beside the tree
#   bash benchmark/gpu_serve_check.sh --dry-run --out DIR    # on a CPU (CI): the same flow on CPU servers
#
# On the GPU machine the bundle is unpacked to GPU_BUNDLE_AT (default /tmp/sglang-graft-bundle) and
# put on PYTHONPATH with this tree's packages; SGLANG_GRAFT_CUDA_STANDIN=1 starts the CUDA profile
# without sgl-kernel where no real sgl-kernel is installed. A machine with SGLang's own CUDA
# install (sglang, sglang-kernel) runs it with --no-bundle. The import-only step runs first, so a
# break in the machine's torch, transformers or Triton costs seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT_DIR="${OUT:-benchmark/out/gpu_serve}"
DRY=()
BUNDLE=1
# the GPU run fits its machine's 8 minutes (optional phases skipped past the budget); a CPU dry run
# runs every phase whatever it takes (five CPU servers on a loaded 2-core machine start in 1-3 minutes)
TIMEOUT=450
BUDGET=380
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR="$2"; shift 2 ;;
        --dry-run) DRY=(--dry-run); BUNDLE=0; TIMEOUT=1500; BUDGET=1400; shift ;;
        --no-bundle) BUNDLE=0; shift ;;
        *) echo "gpu_serve_check.sh: unknown argument $1 (use --out DIR [--dry-run] [--no-bundle])" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT_DIR"
PY="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}"

if [ "$BUNDLE" = 1 ]; then
    if [ ! -f .gpubundle/sglang.tar.xz ] || [ ! -f .gpubundle/site.tar.xz ]; then
        echo "gpu_serve_check.sh: no .gpubundle/ here: build it with bash scripts/gpu_bundle.sh, or pass --no-bundle" >&2
        exit 2
    fi
    export GPU_BUNDLE_AT="${GPU_BUNDLE_AT:-/tmp/sglang-graft-bundle}"
    AT="$GPU_BUNDLE_AT"
    rm -rf "$AT" && mkdir -p "$AT/sglang" "$AT/site"
    tar -xJf .gpubundle/sglang.tar.xz -C "$AT/sglang"
    tar -xJf .gpubundle/site.tar.xz -C "$AT/site"
    export PYTHONPATH="$AT/site:$AT/sglang:$PWD/python:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
    export SGLANG_GRAFT_CUDA_STANDIN=1
    echo "gpu_serve_check: the GPU bundle is unpacked in $AT"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost
[ "${#DRY[@]}" = 0 ] || export OMP_NUM_THREADS=1

rm -f "$OUT_DIR/gpu_serve.json"
echo "== imports"
timeout 150 "$PY" benchmark/gpu_serve_check.py --phase imports --out "$OUT_DIR" "${DRY[@]}"
timeout "${GPU_SERVE_TIMEOUT:-$TIMEOUT}" "$PY" benchmark/gpu_serve_check.py --out "$OUT_DIR" "${DRY[@]}" \
    --budget-s "${GPU_SERVE_BUDGET:-$BUDGET}"

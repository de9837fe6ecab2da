#!/usr/bin/env bash
# Install the CPU profile (idempotent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NO_PROXY=127.0.0.1,localhost
exec .venv/bin/python -m pytest test -q -p no:cacheprovider "$@"

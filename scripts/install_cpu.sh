#!/usr/bin/env bash
# CPU install profile: SGLang 0.5.23 on the CPU build of torch 2.13.0, without SGLang's
# CUDA-only requirements, plus sglang-graft (editable) and its CPU support. Idempotent.
#
#   bash scripts/install_cpu.sh            # venv at ./.venv
#   VENV=/path/to/venv bash scripts/install_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

# 1. torch first, pinned to the CPU build (SGLang pins the CUDA build of 2.14.1): from pip's
#    configured sources where they have it, else from PyTorch's CPU wheel index (PyPI has only the
#    CUDA build, several GB, which this profile does not run).
TORCH=torch==2.13.0+cpu
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null; then
  echo "[install_cpu] $TORCH (about 200 MB)"
  if ! pip install -c requirements/cpu-constraints.txt "$TORCH" 2>/dev/null; then
    echo "[install_cpu] $TORCH is not in pip's configured sources; trying $TORCH_CPU_INDEX (set TORCH_CPU_INDEX to change it)"
    pip install -c requirements/cpu-constraints.txt --extra-index-url "$TORCH_CPU_INDEX" "$TORCH"
  fi
fi
"$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if "+cpu" in torch.__version__ else "torch is not a CPU build: " + torch.__version__)'
# 2. SGLang itself without its dependency pins, 3. its runtime requirements minus CUDA-only ones.
echo "[install_cpu] SGLang 0.5.23 (without its CUDA pins)"
pip install --no-deps sglang==0.5.23
echo "[install_cpu] SGLang's runtime requirements without the CUDA-only ones (requirements/cpu.txt; minutes the first time)"
pip install -c requirements/cpu-constraints.txt -r requirements/cpu.txt
# 4. sglang-graft, editable, without re-resolving SGLang's CUDA pins.
echo "[install_cpu] sglang-graft (editable) and its CPU profile hook"
pip install --no-deps --no-build-isolation -e .
# 5. The interpreter-start hook of the CPU profile (see python/sglang_cpu_port/boot.py); a no-op
#    once sglang-graft is uninstalled (pip leaves this file behind).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp python/sglang_cpu_port/sglang_graft_cpu.pth "$SITE/sglang_graft_cpu.pth"
"$VENV/bin/python" -c 'import sglang_graft, sgl_kernel, torchvision.transforms; print("sglang-graft CPU profile ready:", sgl_kernel.__version__)'

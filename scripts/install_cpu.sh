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

# 1. torch first, pinned to 2.13.0 (SGLang pins the CUDA build of 2.14.1): its CPU build from pip's
#    configured sources where they have it, else from PyTorch's CPU wheel index, else PyPI's build,
#    which carries CUDA libraries (about 3 GB more to download) and runs on a CPU just the same; the
#    profile then leaves a marker beside its hook, since torch's version no longer says "CPU".
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(not torch.__version__.startswith("2.13.0"))' 2>/dev/null; then
  echo "[install_cpu] torch 2.13.0, CPU build (about 200 MB)"
  if ! pip install -c requirements/cpu-constraints.txt torch==2.13.0+cpu 2>/dev/null; then
    echo "[install_cpu] not in pip's configured sources; trying $TORCH_CPU_INDEX (TORCH_CPU_INDEX sets it)"
    if ! pip install --timeout 20 --retries 1 -c requirements/cpu-constraints.txt \
        --extra-index-url "$TORCH_CPU_INDEX" torch==2.13.0+cpu 2>/dev/null; then
      echo "[install_cpu] no CPU build reachable: torch 2.13.0 as pip's sources have it (PyPI: the CUDA build, about 3 GB; it runs on a CPU)"
      "$VENV/bin/python" -m pip --disable-pip-version-check install --progress-bar on \
        -c requirements/cpu-constraints.txt torch==2.13.0
    fi
  fi
fi
"$VENV/bin/python" -W ignore -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else "the CPU profile needs torch 2.13.0, found " + torch.__version__)'
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
rm -f "$SITE/sglang_graft_cpu.force"
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit("+cpu" not in torch.__version__)'; then
  echo "[install_cpu] torch is a CUDA build: the CPU profile is switched on by $SITE/sglang_graft_cpu.force"
  : > "$SITE/sglang_graft_cpu.force"
fi
"$VENV/bin/python" -c 'import sglang_graft, sgl_kernel, torchvision.transforms; print("sglang-graft CPU profile ready:", sgl_kernel.__version__)'

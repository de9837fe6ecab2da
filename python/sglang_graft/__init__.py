"""sglang-graft: the GRAFT speculative-decoding algorithm as an SGLang plugin.

``sglang_graft.retrieval`` and ``sglang_graft.tree`` do not import SGLang, but the package is
an SGLang plugin, so a missing SGLang is reported here with the install line. Set
``SGLANG_GRAFT_STANDALONE=1`` to use the SGLang-free parts alone (for example to check GPU
kernels on a machine that only has torch and triton).
"""

import importlib.util as _util
import os as _os

__version__ = "0.1.0"

if _util.find_spec("sglang") is None and _os.environ.get("SGLANG_GRAFT_STANDALONE") != "1":
    raise ImportError(
        "sglang-graft needs SGLang 0.5.23, which is not installed. "
        "GPU: install SGLang 0.5.23 (`pip install sglang==0.5.23`), then sglang-graft from its source tree "
        "with `pip install --no-deps .` and check with `python scripts/check_install.py --gpu`. "
        "CPU: `bash scripts/install_cpu.sh` from the sglang-graft source tree. "
        "To use only sglang_graft.retrieval / sglang_graft.tree without SGLang, "
        "set SGLANG_GRAFT_STANDALONE=1."
    )

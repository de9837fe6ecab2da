"""Interpreter-start hook of the CUDA profile without sgl-kernel (see the package docstring).

Imported at every interpreter start where the profile is installed (the GPU bundle's
``sitecustomize.py``), before SGLang or its subprocesses import anything. Inert unless
``SGLANG_GRAFT_CUDA_STANDIN=1``; never active where a real ``sgl_kernel`` is importable (then it
says so once on stderr and does nothing). Imports nothing heavy.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

from sglang_cuda_standin import ENV, PROFILE_ENV, STANDIN_DIR


class _SglKernelStandinFinder(importlib.abc.MetaPathFinder):
    """Serves ``sgl_kernel`` from the stand-in folder; placed last, so a real one always wins.
    Its submodules are the stand-in folder's files (found by the path finder under it)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102
        if fullname != "sgl_kernel":
            return None
        return importlib.util.spec_from_file_location(
            "sgl_kernel", STANDIN_DIR / "__init__.py", submodule_search_locations=[str(STANDIN_DIR)])


def requested() -> bool:
    return os.environ.get(ENV) == "1"


def install() -> bool:
    """Set the profile's environment and serve the stand-in; returns whether it is active."""
    if not requested():
        return False
    if any(isinstance(f, _SglKernelStandinFinder) for f in sys.meta_path):
        return True
    real = importlib.util.find_spec("sgl_kernel")
    if real is not None:
        print(f"sglang-graft: {ENV}=1 ignored: a real sgl_kernel is installed ({real.origin})", file=sys.stderr)
        return False
    for name, value in PROFILE_ENV.items():
        os.environ.setdefault(name, value)
    sys.meta_path.append(_SglKernelStandinFinder())
    return True


install()

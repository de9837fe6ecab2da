"""Interpreter-start hook of the CPU install profile (loaded from ``sglang_graft_cpu.pth``).

SGLang 0.5.23 on a CPU without a CPU build of sgl-kernel needs three things before any of its
modules import, in every process it spawns, which is earlier than SGLang's plugin loader runs:

* ``SGLANG_USE_CPU_ENGINE=1``: SGLang's documented switch for its CPU engine (``is_cpu()``).
* the ``torchvision::nms`` / ``qnms`` op schemas: the PyPI torchvision wheel links the CUDA
  build of torch, its ``_C`` fails to load beside the CPU build, and its meta registrations
  then fail on import (SGLang imports ``torchvision.transforms`` unconditionally).
* an importable ``sgl_kernel``: SGLang's CPU paths ``from sgl_kernel import ..._cpu`` at module
  import time. Our stand-in (pure-torch implementations) is served under that name only when no
  real ``sgl_kernel`` is installed.

It also installs ``quiet``: filters for the warnings SGLang prints on every CPU start that only
say the machine has no CUDA (see ``quiet.py``).

Only the CPU profile installs the ``.pth`` file, and the hook stays inert unless torch is a
CPU build (``+cpu`` local version), the profile was installed over PyPI's CUDA build of torch (it
then leaves the marker file ``FORCE_MARKER`` beside the ``.pth``), or ``SGLANG_GRAFT_CPU=1``;
``SGLANG_GRAFT_CPU=0`` turns it off. It imports nothing heavy at start-up: torch is touched only
when torchvision is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parent / "sgl_kernel_standin"
FORCE_MARKER = "sglang_graft_cpu.force"  # in site-packages: install_cpu.sh kept a CUDA build of torch


def cpu_profile_active() -> bool:
    """True when this interpreter should run SGLang on the CPU through sglang-graft."""
    forced = os.environ.get("SGLANG_GRAFT_CPU")
    if forced is not None:
        return forced == "1"
    try:
        if "+cpu" in importlib.metadata.version("torch"):
            return True
    except importlib.metadata.PackageNotFoundError:
        return False
    # sys.path, not site.getsitepackages(): while .pth files are read, the latter still names the
    # base interpreter's directories in a venv; the site directory itself is already on sys.path
    return any((Path(p) / FORCE_MARKER).is_file() for p in sys.path if p.endswith("-packages"))


def define_torchvision_schemas() -> None:
    """Define the two op schemas torchvision's meta registrations expect, unless its ``_C`` loads."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    for lib_path in Path(spec.submodule_search_locations[0]).glob("_C*.so"):
        try:
            torch.ops.load_library(str(lib_path))
            return  # torchvision's own kernels load: nothing to stand in for
        except OSError:
            break
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(lib)


_KEEP: list = []  # keeps the torch.library fragment alive for the process lifetime


class _TorchvisionSchemaHook(importlib.abc.MetaPathFinder):
    """Runs ``define_torchvision_schemas`` right before the first import of torchvision."""

    done = False

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102
        if fullname == "torchvision" and not self.done:
            type(self).done = True
            define_torchvision_schemas()
        return None  # the normal finders load torchvision itself


class _SglKernelStandinFinder(importlib.abc.MetaPathFinder):
    """Serves the stand-in package as ``sgl_kernel``; placed last, so a real one always wins."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102
        if fullname != "sgl_kernel":
            return None
        return importlib.util.spec_from_file_location(
            "sgl_kernel",
            STANDIN_DIR / "__init__.py",
            submodule_search_locations=[str(STANDIN_DIR)],
        )


def install() -> bool:
    """Install the environment switch and both import hooks; returns whether they are active."""
    if not cpu_profile_active():
        return False
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if not any(isinstance(f, _TorchvisionSchemaHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionSchemaHook())
    if not any(isinstance(f, _SglKernelStandinFinder) for f in sys.meta_path):
        sys.meta_path.append(_SglKernelStandinFinder())
    from sglang_cpu_port import quiet

    quiet.install(active=True)
    return True


install()

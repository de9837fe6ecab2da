"""Make this CPU process look like a CUDA machine to SGLang's import-time checks (test helper).

Import it before SGLang: ``torch.cuda.is_available()`` is True and ``torch.version.cuda`` is set, so
``sglang.srt.utils.is_cuda()`` holds and SGLang's modules take their CUDA branches at import (which
``sgl_kernel`` names and submodules they import, which kernels they bind). Nothing here runs a CUDA
kernel: it checks imports, not execution. The CPU profile's torchvision schemas are defined, since
this CPU build of torch cannot load torchvision's own kernels (on a CUDA machine they load).

Run with ``SGLANG_GRAFT_CPU=0`` (the CPU profile off) and, for the CUDA profile without sgl-kernel,
``SGLANG_GRAFT_CUDA_STANDIN=1`` with ``sglang_cuda_standin.boot`` imported first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from sglang_cpu_port import boot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from gpu_serve_check import SERVING_MODULES  # noqa: E402,F401 (what SGLang imports to serve GRAFT on CUDA)

if not any(isinstance(f, boot._TorchvisionSchemaHook) for f in sys.meta_path):
    sys.meta_path.insert(0, boot._TorchvisionSchemaHook())
torch.cuda.is_available = lambda: True
torch.version.cuda = "13.0"
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_capability = lambda *args: (9, 0)
torch.cuda.get_device_name = lambda *args: "a CUDA device faked on a CPU (imports only)"

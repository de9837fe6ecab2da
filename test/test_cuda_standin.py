"""The CUDA profile without sgl-kernel (``sglang_cuda_standin``), checked on a CPU.

1. Its torch ops equal SGLang's own Triton kernels, run by the Triton interpreter on CPU tensors:
   the sampling renormalisations (SGLang's ROCm fallbacks, with FlashInfer's threshold semantics)
   on rows with ties, top-k / top-p at and beyond their ends; the fused MoE's reduction over
   experts (``moe_sum_reduce``), scaled and not.
2. SGLang's CUDA import path (``torch`` made to report a CUDA device, ``test/fake_cuda.py``) imports
   with ``sgl_kernel`` served by the stand-in: the launcher, scheduler, model runner, EAGLE V2
   worker, Triton attention backend, the check's models and GRAFT's worker. The submodules SGLang
   imports at module level are served, others are not (SGLang's ImportError fallbacks hold);
   ``is_arch_support_pdl()`` is False; an op the profile lacks raises naming itself; the plugin
   points SGLang's speculative verify at the torch sampling ops.
3. The switch: inert without ``SGLANG_GRAFT_CUDA_STANDIN=1``, and where a real ``sgl_kernel`` is
   importable it stays off and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = Path(__file__).resolve().parent


def _run(script: str, env: dict, timeout: float = 300) -> dict:
    """Run ``script`` in a fresh interpreter; it prints one JSON line prefixed ``RESULT``."""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(TEST), **env})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


RENORM = r"""
import json, torch
import sglang.kernels.ops.sampling.renorm_triton as R
from sglang_graft.sglang import sampling
R._prepare_probs = lambda p: p.float().contiguous()  # SGLang's entry check wants a CUDA tensor; the kernels run interpreted
gen = torch.Generator().manual_seed(7)
out = {"k": [], "p": []}
for vocab in (37, 1500):
    logits = torch.randn(6, vocab, generator=gen) * 3
    logits[1, :9] = logits[1, 9]                    # a tie across the top-k / top-p pivot
    logits[2] = 0.0                                 # a flat row
    probs = torch.softmax(logits, -1)
    ks = torch.tensor([1, 5, 9, 10, vocab, 1 << 30], dtype=torch.int32)
    ps = torch.tensor([0.05, 0.5, 0.9, 0.999, 1.0, 0.3])
    for kind, theirs, ours, arg in (("k", R.top_k_renorm_probs_triton, sampling.top_k_renorm_prob, ks),
                                    ("p", R.top_p_renorm_probs_triton, sampling.top_p_renorm_prob, ps)):
        a, b = theirs(probs, arg), ours(probs, arg)
        out[kind].append([float((a - b).abs().max()), int(((a > 0) != (b > 0)).sum())])
import sglang.kernels.ops.moe.fused_moe_triton_kernels as M
from sglang_cuda_standin.ops import moe_sum_reduce
M.is_arch_support_pdl = lambda: False  # SGLang asks the device; no programmatic launch on a CPU
out["moe"] = []
for tokens, topk, hidden, scale in ((1, 4, 128, 1.0), (40, 4, 96, 2.5), (7, 8, 2100, 0.5)):
    x = torch.randn(tokens, topk, hidden, generator=gen)
    theirs, ours = torch.empty(tokens, hidden), torch.full((tokens, hidden), float("nan"))
    M.moe_sum_reduce_triton(x, theirs, scale)
    moe_sum_reduce(x, ours, scale)
    out["moe"].append(float((theirs - ours).abs().max()))
print("RESULT", json.dumps(out))
"""


def test_the_torch_ops_equal_sglangs_triton_kernels():
    result = _run(RENORM, {"TRITON_INTERPRET": "1"})
    for kind in ("k", "p"):
        for max_diff, support_diff in result[kind]:
            assert support_diff == 0 and max_diff < 1e-6, result
    assert len(result["moe"]) == 3 and max(result["moe"]) < 1e-5, result


CUDA_IMPORTS = r"""
import json, importlib, sys
import sglang_cuda_standin.boot                      # what the GPU bundle's sitecustomize.py imports
import fake_cuda
import sglang_cuda_standin as S
for name in fake_cuda.SERVING_MODULES:
    importlib.import_module(name)
import sgl_kernel, sgl_kernel.utils, sgl_kernel.kvcacheio, sgl_kernel.quantization
from sglang.srt.utils import is_cuda
from sglang.srt.speculative import eagle_utils
from sglang_graft.sglang import sampling
try:
    import sgl_kernel.scalar_type
    fallback = False
except ImportError:
    fallback = True
from sglang.srt.layers.quantization import utils as qutils
try:
    sgl_kernel.kvcacheio.transfer_kv_per_layer(1, 2)
    missing = None
except S.KernelUnavailable as e:
    missing = str(e)
before = eagle_utils.tree_speculative_sampling_target_only
S.register()
import os
print("RESULT", json.dumps({
    "is_cuda": is_cuda(), "standin": S.standin_active(), "file": sgl_kernel.__file__,
    "pdl": sgl_kernel.utils.is_arch_support_pdl(), "scalar_type_fallback": fallback,
    "mock_scalar_types": type(qutils.scalar_types).__name__, "missing": missing,
    "ops": [getattr(eagle_utils, n) is f for n, f in (("top_k_renorm_prob", sampling.top_k_renorm_prob),
            ("top_p_renorm_prob", sampling.top_p_renorm_prob),
            ("tree_speculative_sampling_target_only", sampling.cpu_sampling_verify))],
    "replaced": before is not eagle_utils.tree_speculative_sampling_target_only,
    "env": [os.environ.get(k) for k in S.PROFILE_ENV],
    "sampler_top_k": sys.modules["sglang.srt.layers.sampler"].top_k_renorm_prob is sampling.top_k_renorm_prob,
    "moe_sum_reduce": importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe").moe_sum_reduce
                      is importlib.import_module("sglang_cuda_standin.ops").moe_sum_reduce,
}))
"""


def test_sglangs_cuda_import_path_runs_on_the_standin():
    r = _run(CUDA_IMPORTS, {"SGLANG_GRAFT_CPU": "0", "SGLANG_GRAFT_CUDA_STANDIN": "1"})
    assert r["is_cuda"] and r["standin"], r
    assert Path(r["file"]).parent == ROOT / "python" / "sglang_cuda_standin" / "sgl_kernel_standin"
    assert r["pdl"] is False
    assert r["scalar_type_fallback"] and r["mock_scalar_types"] == "MockScalarTypes", r
    assert r["missing"].startswith("sgl_kernel.kvcacheio.transfer_kv_per_layer is not provided"), r
    assert r["ops"] == [True, True, True] and r["replaced"], r
    assert r["env"] == ["torch", "1"], r  # SGLANG_FORCE_FUSED_OP_BACKEND, SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK
    assert r["sampler_top_k"] and r["moe_sum_reduce"], r


SWITCH = r"""
import json, importlib.util, sys
import sglang_cuda_standin.boot as boot
spec = importlib.util.find_spec("sgl_kernel")
print("RESULT", json.dumps({"active": boot.install(), "origin": spec.origin if spec else None}))
"""


def test_the_profile_is_off_without_its_switch_and_beside_a_real_sgl_kernel(tmp_path):
    off = _run(SWITCH, {"SGLANG_GRAFT_CPU": "0", "SGLANG_GRAFT_CUDA_STANDIN": "0"})
    assert off == {"active": False, "origin": None}, off
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    env = {"SGLANG_GRAFT_CPU": "0", "SGLANG_GRAFT_CUDA_STANDIN": "1", "PYTHONPATH": f"{TEST}:{tmp_path}"}
    proc = subprocess.run([sys.executable, "-c", SWITCH], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result == {"active": False, "origin": str(real / "__init__.py")}, proc.stderr
    assert "SGLANG_GRAFT_CUDA_STANDIN=1 ignored: a real sgl_kernel is installed" in proc.stderr

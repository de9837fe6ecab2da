"""A quiet start and stop of SGLang 0.5.23 in the CPU profile.

At ``--log-level warning`` SGLang prints, on every CPU start, warnings that only say the machine
has no CUDA, or that a model module this profile cannot serve was skipped. Each is dropped here by
its emitter (the logger, or the module that calls ``warnings.warn``) and its message pattern;
nothing else from those loggers is touched, records above WARNING never are, and at
``--log-level debug`` the dropped records still print (as DEBUG). Installed by the profile's boot
hook (``boot.install``), so it covers every process SGLang spawns and nothing outside the profile:
on a CUDA build of torch nothing here runs.

What is dropped, and why it says nothing to act on:

* ``sglang.srt.models.registry``: ``Ignore import error when loading sglang.srt.models.X: CAUSE``
  (once per skipped module while SGLang scans its model registry), where CAUSE is one of: a CPU
  kernel that neither SGLang's CPU build of sgl-kernel nor our stand-in has been asked to provide
  (``'_OpNamespace' 'sgl_kernel' object has no attribute '..._cpu'``, looked up at import time), a
  package the CPU profile leaves out (:data:`LEFT_OUT`), or the causal-conv1d kernels SGLang's
  mamba layer binds on CUDA/NPU/XPU only. Any other cause (a real bug in a model module) stays.
* ``sglang.kernels.jit.utils.arch``: ``Cannot detect CUDA architecture.``, from
  ``is_arch_support_pdl()`` at import of ``trtllm_mla_backend`` (pulled in by the registry scan);
  dropped only on a build of torch without CUDA.
* ``sglang.srt.utils.common``: ``Fail to set RLIMIT_NOFILE: ...``: SGLang asks for a soft limit
  of 65535 open files and gives up when the hard limit is lower; dropped only when the soft limit
  already equals the hard limit, the most an unprivileged process can have
  (:func:`raise_nofile_limit` raises it that far).
* ``sglang.srt.distributed.bootstrap``: ``init_cpu_threads_env and shared memory based AllReduce
  is disabled, ...``: true of every x86 CPU without AMX, the machines this profile exists for.
* Python warnings (``UserWarning``) at import: ``Only CUDA, HIP and XPU support AWQ currently.``
  (``...quantization.awq.awq``), ``Only CUDA, MUSA and NPU support GGUF quantization currently.``
  (``...quantization.gguf``), ``Triton is not supported on current platform, roll back to CPU.``
  (``sglang.kernels.ops.attention.fla.utils``).
* At interpreter exit of an SGLang server process: triton's ``libtriton`` prints a nanobind
  reference-leak report from its own teardown (``nanobind: leaked N instances! ...``) after a
  clean stop. Triton silences the same report for its own compile workers by pointing stderr at
  /dev/null at exit (``triton._compile_warmup_pool``); :func:`_silence_triton_teardown` does the
  same, as the last exit handler, so every traceback and exit handler prints before it.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import resource
import sys
import warnings

# Import names of the packages the CPU profile leaves out (requirements/cpu.txt).
LEFT_OUT = ("flashinfer", "flash_attn", "deep_ep", "deep_gemm", "flash_mla", "nvidia", "nvshmem", "cuda",
            "cutlass", "quack", "tilelang", "humming", "torch_memory_saver", "torchaudio", "torchcodec",
            "timm", "kernels", "modelscope")

_SKIPPED_MODEL = re.compile(r"Ignore import error when loading sglang\.srt\.models\.[\w.]+: (?P<cause>.*)", re.S)
_CPU_PLATFORM_CAUSES = (
    re.compile(r"'_OpNamespace' 'sgl_kernel' object has no attribute '\w+'"),
    re.compile(r"No module named '(?:%s)(?:\.[\w.]+)?'" % "|".join(LEFT_OUT)),
    re.compile(r"cannot import name 'causal_conv1d_\w+' from 'sglang\.srt\.layers\.attention\.mamba\.mamba' \(.*\)"),
)


def _skipped_for_cpu(message: str) -> bool:
    m = _SKIPPED_MODEL.fullmatch(message)
    return m is not None and any(c.fullmatch(m.group("cause")) for c in _CPU_PLATFORM_CAUSES)


def _torch_without_cuda() -> bool:
    """torch is a CPU build, or a CUDA build on a machine without a GPU (the CPU profile over
    PyPI's torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and (getattr(torch.version, "cuda", "") is None or not torch.cuda.is_available())


def _nofile_at_hard_limit() -> bool:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft == hard


# logger name -> predicate on the formatted message (WARNING records only)
RULES = {
    "sglang.srt.models.registry": _skipped_for_cpu,
    "sglang.kernels.jit.utils.arch": lambda m: m == "Cannot detect CUDA architecture." and _torch_without_cuda(),
    "sglang.srt.utils.common": lambda m: m.startswith("Fail to set RLIMIT_NOFILE: ") and _nofile_at_hard_limit(),
    "sglang.srt.distributed.bootstrap": lambda m: m.startswith(
        "init_cpu_threads_env and shared memory based AllReduce is disabled, "
        "only intel amx backend and arm64 are supported"),
}
LOGGERS = tuple(RULES)

# (message regex, emitting module regex) of UserWarnings, as ``warnings.filterwarnings`` takes them
WARNINGS = (
    (r"Only CUDA, HIP and XPU support AWQ currently\.", r"sglang\.srt\.layers\.quantization\.awq\.awq\Z"),
    (r"Only CUDA, MUSA and NPU support GGUF quantization currently\.", r"sglang\.srt\.layers\.quantization\.gguf\Z"),
    (r"Triton is not supported on current platform, roll back to CPU\.", r"sglang\.kernels\.ops\.attention\.fla\.utils\Z"),
)


class QuietFilter(logging.Filter):
    """Drops the WARNING records of :data:`RULES` (prints them as DEBUG where DEBUG is enabled)."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: A003
        rule = RULES.get(record.name)
        if rule is None or record.levelno != logging.WARNING:
            return True
        try:
            matched = rule(record.getMessage())
        except Exception:  # a filter must never lose a record
            return True
        if not matched:
            return True
        if logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return True
        return False


def _silence_triton_teardown() -> None:
    """Exit handler of SGLang server processes that loaded libtriton: stderr to /dev/null, so
    libtriton's nanobind leak report at interpreter teardown is not printed."""
    if "triton._C.libtriton" not in sys.modules or not any(
            m in sys.modules for m in ("sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                                       "sglang.srt.managers.detokenizer_manager")):
        return
    try:
        sys.stderr.flush()
    except Exception:
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


_installed = False


def install(active: bool | None = None) -> bool:
    """Install the log and warning filters and the exit handler; a no-op (returns False) unless
    the CPU profile is active (``active=None``: ask ``boot.cpu_profile_active()``)."""
    global _installed
    if active is None:
        from sglang_cpu_port.boot import cpu_profile_active

        active = cpu_profile_active()
    if not active:
        return False
    if _installed:
        return True
    _installed = True
    atexit.register(_silence_triton_teardown)  # registered at interpreter start: runs last
    quiet = QuietFilter()
    for name in LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    for message, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    return True


def raise_nofile_limit(target: int = 65535) -> None:
    """Raise the soft limit on open files towards SGLang's target as far as the hard limit allows
    (SGLang asks for ``target`` and, when the hard limit is lower, changes nothing)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass

#!/usr/bin/env python3
"""Check an installed sglang-graft against the installed SGLang, without a model or a device.

1. SGLang is the version sglang-graft pins;
2. the ``sglang.srt.plugins`` entry point names sglang-graft's ``register``;
3. ``register()`` runs (it registers ``--speculative-algorithm GRAFT`` and GRAFT's hooks; called
   directly, since SGLang's plugin loader only logs a plugin that raises);
4. SGLang applies the registered hooks (``HookRegistry.apply_hooks()``, what its plugin loader
   calls after the plugins) and every GRAFT hook is applied (``seams.check_hooks_applied``);
5. GRAFT's worker classes import (their import checks that every method they override exists in
   SGLang) and the algorithm is registered;
6. every seam listed in ``sglang_graft.sglang.seams`` resolves (a seam may resolve to None, e.g. a
   CUDA kernel on a CPU build; only a missing one fails).

With ``--gpu`` (the GPU image) it also checks that torch is a CUDA build and that torch,
sglang-kernel and flashinfer are the versions SGLang pins.

    python scripts/check_install.py [--gpu]

Exits 0 when every check holds, else 1 with each failure (and the SGLang symbol) on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as metadata
import sys
import traceback
from typing import Callable

PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_TARGET = "sglang_graft.sglang.plugin:register"
GPU_PINNED = ("torch", "sglang-kernel", "flashinfer-python")


class Failed(Exception):
    """One check failed; its message says what and where."""


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def check_sglang_version() -> str:
    from sglang_graft.sglang import seams

    installed = _version("sglang")
    if installed != seams.PINNED_SGLANG:
        raise Failed(f"SGLang {installed} is installed; sglang-graft needs SGLang {seams.PINNED_SGLANG}")
    return f"SGLang {installed}"


def check_entry_point() -> str:
    found = [ep for ep in metadata.entry_points(group=PLUGIN_GROUP) if ep.value == PLUGIN_TARGET]
    if not found:
        raise Failed(f"no {PLUGIN_GROUP} entry point names {PLUGIN_TARGET}: SGLang would not load GRAFT "
                     "(is sglang-graft installed as a distribution?)")
    return f"entry point {PLUGIN_GROUP}: {found[0].name} = {PLUGIN_TARGET}"


def check_register() -> str:
    import sglang_cpu_port
    from sglang_graft.sglang import plugin, seams

    plugin.register()
    sglang_cpu_port.register()  # the CPU port's own plugin (a no-op off the CPU profile), as SGLang's loader would
    hooks = seams.registered_hooks()
    if not hooks:
        raise Failed("register() registered no hook with SGLang's HookRegistry")
    return f"register() ran: {len(hooks)} hooked SGLang functions"


def check_hooks_applied() -> str:
    from sglang_graft.sglang import seams

    seams.HOOK_REGISTRY.resolve().apply_hooks()
    seams.check_hooks_applied()
    return f"HookRegistry applied every GRAFT hook ({len(seams.registered_hooks())})"


def check_workers() -> str:
    from sglang_graft.sglang import algorithm, seams

    importlib.import_module("sglang_graft.sglang.draft_worker")  # check_overrides at import
    importlib.import_module("sglang_graft.sglang.worker")
    if seams.GET_REGISTERED_SPEC.resolve()(algorithm.NAME) is None:
        raise Failed(f"--speculative-algorithm {algorithm.NAME} is not registered with SGLang")
    return f"worker classes override SGLang methods; --speculative-algorithm {algorithm.NAME} registered"


def all_seams() -> list:
    """Every seam the ``seams`` module lists (one by one or in tuples), each once."""
    from sglang_graft.sglang import seams

    found: dict = {}
    for value in vars(seams).values():
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, seams.Seam):
                found.setdefault(item.target, item)
    return list(found.values())


def check_seams() -> str:
    from sglang_graft.sglang import seams

    listed = all_seams()
    missing = []
    for seam in listed:
        if not seam.static:
            continue  # an attribute of SGLang instances, checked where it is read
        try:
            seam.resolve()
        except seams.SeamError as e:
            missing.append(str(e))
    if missing:
        raise Failed(f"{len(missing)} of {len(listed)} SGLang seams missing:\n  " + "\n  ".join(missing))
    static = sum(s.static for s in listed)
    return f"{static} SGLang seams resolve ({len(listed) - static} instance attribute(s) checked at use)"


def check_gpu_pins() -> str:
    import torch
    from packaging.requirements import Requirement

    if torch.version.cuda is None:
        raise Failed(f"torch {torch.__version__} is not a CUDA build")
    pins = {}
    for line in metadata.requires("sglang") or ():
        req = Requirement(line)
        if req.name.lower().replace("_", "-") in GPU_PINNED and (req.marker is None or req.marker.evaluate()):
            pins[req.name.lower().replace("_", "-")] = req.specifier
    wrong = [f"{name} {_version(name)} (SGLang requires {name}{spec})" for name, spec in sorted(pins.items())
             if _version(name) == "not installed" or not spec.contains(_version(name), prereleases=True)]
    if wrong:
        raise Failed("not the versions SGLang pins: " + "; ".join(wrong))
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}), " + ", ".join(
        f"{name} {_version(name)}" for name in sorted(pins) if name != "torch")


def _describe(error: Exception) -> str:
    """A failed check's message; a traceback only for what no check anticipated."""
    try:
        from sglang_graft.sglang.seams import SeamError
    except Exception:  # noqa: BLE001 - sglang-graft itself may be what is broken
        SeamError = Failed
    if isinstance(error, (Failed, SeamError)):
        return str(error)
    return "".join(traceback.format_exception(error)).rstrip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true",
                        help="also require a CUDA build of torch and SGLang's pins of torch, sglang-kernel, flashinfer")
    args = parser.parse_args(argv)

    checks: list[tuple[str, Callable[[], str], bool]] = [  # (name, check, later checks need it)
        ("sglang version", check_sglang_version, False),
        ("plugin entry point", check_entry_point, False),
        ("plugin registration", check_register, True),
        ("hooks applied", check_hooks_applied, False),
        ("worker classes", check_workers, False),
        ("seams", check_seams, False),
    ]
    if args.gpu:
        checks.append(("GPU pins", check_gpu_pins, False))

    print(f"sglang-graft {_version('sglang-graft')}, Python {sys.version.split()[0]}, torch {_version('torch')}")
    failures = 0
    for name, check, required in checks:
        try:
            print(f"ok   {name}: {check()}", flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported, with its SGLang symbol
            failures += 1
            detail = _describe(e)
            print(f"FAIL {name}: {detail}", file=sys.stderr, flush=True)
            if required:
                print("     (later checks skipped: they need a registered plugin)", file=sys.stderr)
                break
    if failures:
        print(f"sglang-graft install check: {failures} check(s) failed", file=sys.stderr)
        return 1
    print("sglang-graft install check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

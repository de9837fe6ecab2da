"""Compile LLVM IR for the host CPU with llvmlite (numba's code generator, installed with SGLang):
the one place the CPU port's hand-written kernels (:mod:`gemm_ir`, :mod:`kv_move_ir`) are built."""

from __future__ import annotations


class Compiled:
    """An LLVM IR module compiled for this host; ``address(name)`` of each function (kept alive
    with the engine held here)."""

    def __init__(self, module_ir: str) -> None:
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        machine = llvm.Target.from_default_triple().create_target_machine(
            cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(), opt=3)
        parsed = llvm.parse_assembly(module_ir)
        parsed.verify()
        self._engine = llvm.create_mcjit_compiler(parsed, machine)
        self._engine.finalize_object()
        self._module, self._machine = parsed, machine

    def address(self, name: str) -> int:
        return self._engine.get_function_address(name)

    def assembly(self) -> str:
        """The host code the module compiled to (for inspection)."""
        return self._machine.emit_assembly(self._module)

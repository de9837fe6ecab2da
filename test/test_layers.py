"""Folders are layers: which package may import which, and no import cycle (SGLang only through
``seams.py``: ``test_seams.py``).

| package | owns | may import |
|---|---|---|
| ``sglang_graft.tree`` | prune, graft, flatten, the torch reference of verification | ``kernels`` |
| ``sglang_graft.retrieval`` | suffix automaton / n-gram stores, the recycling matrix | ``tree``, ``kernels`` |
| ``sglang_graft.config`` | the algorithm's one config and its flags | ``tree``, ``retrieval`` |
| ``sglang_graft.engine`` | per-step decisions, cost model, retrieval state (SGLang-free) | the above |
| ``sglang_graft.kernels`` | which implementation runs; the Triton sources (``sglang_graft_kernels``) | -- |
| ``sglang_graft.sglang`` | everything that touches SGLang (worker, draft worker, hooks, seams) | all of ``sglang_graft`` |
| ``sglang_cpu_port`` | SGLang on a CPU (not GRAFT) | ``sglang_graft.sglang.seams``, ``sglang_graft.tree`` |
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "python" / "sglang_graft", ROOT / "python" / "sglang_cpu_port", ROOT / "kernels" / "sglang_graft_kernels"]
OURS = ("sglang_graft", "sglang_cpu_port", "sglang_graft_kernels")

ALLOWED = {
    "sglang_graft.tree": {"sglang_graft.kernels"},
    "sglang_graft.retrieval": {"sglang_graft.tree", "sglang_graft.kernels"},
    "sglang_graft.config": {"sglang_graft.tree", "sglang_graft.retrieval"},
    "sglang_graft.engine": {"sglang_graft.tree", "sglang_graft.retrieval", "sglang_graft.config",
                            "sglang_graft.kernels", "sglang_graft.graphs"},
    "sglang_graft.graphs": {"sglang_graft.tree", "sglang_graft.kernels"},
    "sglang_graft.kernels": {"sglang_graft_kernels"},
    "sglang_graft_kernels": set(),
    "sglang_graft.sglang": {"sglang_graft", "sglang_graft.tree", "sglang_graft.retrieval", "sglang_graft.config",
                            "sglang_graft.engine", "sglang_graft.kernels"},
    "sglang_cpu_port": {"sglang_graft.sglang.seams", "sglang_graft.tree"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            parts = path.relative_to(package.parent).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _module_level(tree: ast.Module):
    """The statements that run when the module is imported (not function or class bodies)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _imports(module: str, path: Path, at_import: bool = False) -> set[str]:
    """Our modules ``module`` imports (``from a import b`` counts ``a.b`` when that is a module);
    ``at_import``: only the imports that run when it is imported."""
    known = _modules()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    for node in (_module_level(tree) if at_import else ast.walk(tree)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {n for n in names if n.split(".")[0] in OURS}
    return out


def _layer(module: str) -> str:
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return module  # the package root (sglang_graft/__init__.py)


def _allowed(source: str, target: str) -> bool:
    layer, target_layer = _layer(source), _layer(target)
    if layer == target_layer:
        return True
    allowed = ALLOWED.get(layer, set())
    return target_layer in allowed or any(target == a or target.startswith(a + ".") for a in allowed)


def test_every_package_imports_only_the_layers_below_it():
    wrong = sorted(f"{m} imports {t}" for m, p in _modules().items() for t in _imports(m, p) if not _allowed(m, t))
    assert wrong == []


def test_no_import_cycle():
    """Among the imports that run at import time (a function's lazy import is not a cycle; a
    package's ``__init__`` importing its own submodules is not an edge)."""
    modules = _modules()
    graph = defaultdict(set)
    for m, p in modules.items():
        for t in _imports(m, p, at_import=True):
            while t not in modules and "." in t:
                t = t.rpartition(".")[0]
            if t in modules and t != m and not (p.name == "__init__.py" and t.startswith(m + ".")):
                graph[m].add(t)
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(modules):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_layer_rules_catch_an_upward_import():
    assert not _allowed("sglang_graft.engine.step", "sglang_graft.sglang.worker")
    assert not _allowed("sglang_graft.tree.prune", "sglang_graft.engine.budget")
    assert not _allowed("sglang_cpu_port.moe", "sglang_graft.sglang.worker")
    assert not _allowed("sglang_graft.sglang.plugin", "sglang_cpu_port")
    assert _allowed("sglang_cpu_port", "sglang_graft.sglang.seams")
    assert _imports("sglang_graft.tree.flatten", ROOT / "python/sglang_graft/tree/flatten.py") >= {"sglang_graft.kernels"}


# SGLang's names for GRAFT's quantities (see the glossary in ``sglang_graft/tree/types.py``): used as
# identifiers only where SGLang is spoken, the adapter (``sglang_graft.sglang``), the CPU port of
# SGLang, and ``tree/draft.py``, which reads SGLang's draft outputs.
SGLANG_NAMES = {"speculative_num_draft_tokens", "draft_token_num", "num_draft_tokens", "num_verify_tokens",
                "retrive_index", "retrive_next_token", "retrive_next_sibling", "retrieve_index",
                "retrieve_next_token", "retrieve_next_sibling", "verified_id"}
SPEAKS_SGLANG = ("sglang_graft.sglang", "sglang_cpu_port", "sglang_graft.tree.draft")


def _identifiers(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def test_sglang_names_stay_where_sglang_is_spoken():
    offenders = {}
    for module, path in _modules().items():
        if any(module == p or module.startswith(p + ".") for p in SPEAKS_SGLANG):
            continue
        used = _identifiers(path) & SGLANG_NAMES
        if used:
            offenders[module] = sorted(used)
    assert not offenders, offenders


def test_the_name_check_sees_identifiers():
    """Negative control: the check finds an SGLang name used as an argument, an attribute and a keyword."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.py"
        path.write_text("def f(draft_token_num):\n    return g(x.retrive_index, verified_id=1)\n")
        assert _identifiers(path) & SGLANG_NAMES == {"draft_token_num", "retrive_index", "verified_id"}

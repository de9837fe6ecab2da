"""The sam source's warm-up compiles every numba kernel a served request's store calls, so no request
stalls on a compile (a measured load run once spent about 3 s compiling the automaton's rehash and
proposal walk inside its first steps, past a warm-up that never reached them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"

# Run in a fresh interpreter: kernels this test process compiled for other tests would hide a gap.
_SCRIPT = textwrap.dedent('''
    import json, random, sys

    import numba

    from sglang_graft.config import GraftConfig
    from sglang_graft.retrieval.source import SourceContext
    from sglang_graft.retrieval.store_source import StoreSource


    def overloads():
        """{module.kernel: compiled signatures} of every numba kernel of the retrieval package."""
        out = {}
        for module in list(sys.modules.values()):
            name = getattr(module, "__name__", "") or ""
            if name.startswith("sglang_graft.retrieval"):
                for attr, value in vars(module).items():
                    if isinstance(value, numba.core.registry.CPUDispatcher):
                        out[f"{name}.{attr}"] = len(value.signatures)
        return out


    source = StoreSource.from_config(GraftConfig(), SourceContext(vocab_size=50, num_nodes=16, device="cpu",
                                                                  max_requests=8))
    source.warm_up()
    warm = overloads()
    rng = random.Random(0)
    phrase = [rng.randrange(50) for _ in range(12)]
    prompts = {"short": [1, 2, 3], "long": [rng.randrange(50) for _ in range(1500)] + phrase * 3}
    for rid, prompt in prompts.items():
        source.admit(rid, prompt, None, None)
    for step in range(300):
        for rid in prompts:
            chunk = phrase[step % 12 : step % 12 + 1 + step % 3] if step % 5 else [rng.randrange(50)]
            source.extend(rid, chunk)
            source.store.propose([rid], source.max_depth, source.num_nodes - 1)
    served = overloads()
    print(json.dumps({"warm": warm, "served": served}))
''')


def test_warm_up_compiles_what_a_request_calls(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=str(PYTHON_DIR))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    warm, served = report["warm"], report["served"]
    assert sum(served.values()) > 10  # the kernels were found and ran
    late = {name: (warm.get(name, 0), n) for name, n in served.items() if n != warm.get(name, 0)}
    assert not late, f"compiled only while serving (signatures after warm-up, after serving): {late}"


def test_the_recycle_warm_up_writes_only_its_dump_row_and_serving_shapes_do_not_specialise(monkeypatch):
    """The recycle source's warm-up runs one table update (on CUDA: compiles ``recycle_scatter``,
    which the first verify step would otherwise wait for) into the dump row: no row a proposal reads
    changes. The scatter and the mask kernel take the step's node count / batch size unspecialised
    (Triton would compile a new variant for 1, multiples of 16 and the rest while serving)."""
    import torch

    from sglang_graft.config import GraftConfig
    from sglang_graft.retrieval.recycle_source import RecycleSource
    from sglang_graft.retrieval.source import SourceContext
    import sglang_graft_kernels  # noqa: F401 (its modules, by name: the package re-exports functions of the same names)

    recycle, tree_mask = (sys.modules[f"sglang_graft_kernels.{name}"] for name in ("recycle", "tree_mask"))

    source = RecycleSource.from_config(GraftConfig(), SourceContext(vocab_size=50, num_nodes=16, device="cpu",
                                                                    max_requests=8))
    matrix = source.matrix
    before = matrix.successors.clone()
    calls = []
    update = matrix.update
    monkeypatch.setattr(matrix, "update", lambda *a, **k: calls.append((a, k)) or update(*a, **k))
    source.warm_up()
    assert len(calls) == 1 and not calls[0][1]["valid"].any()
    changed = (matrix.successors != before).any(dim=1).nonzero().flatten().tolist()
    dump_rows = {scope * matrix.rows_per_scope + matrix.vocab_size + 1 for scope in range(matrix.num_scopes)}
    assert set(changed) <= dump_rows, changed
    assert recycle._recycle_scatter_kernel.do_not_specialize == ["n"]
    assert tree_mask._tree_mask_kernel.do_not_specialize == ["bs"]

"""Every timed batch step of GRAFT's block mode, one JSON line each, to the file ``STEP_LOG`` names:
batch size, kind (``drafted``; ``guarded``: left to the chains by a rate guard; ``plain``: the roots
alone), the previous step's kind, seconds, committed tokens. Put this directory first on a server's
``PYTHONPATH`` with ``STEP_LOG`` set; it wraps ``GraftDFlashWorker._time_step`` when that module is
imported (the decisions are unchanged)::

    STEP_LOG=out/steps.jsonl PYTHONPATH=benchmark/studies/block_step_log:$PYTHONPATH \
        python benchmark/serving_bench.py --split report --methods GRAFT-DFlash --concurrency 8 --prompts-per-level 24
"""
import importlib.abc, importlib.util, json, os, sys

def _patch(module):
    cls = module.GraftDFlashWorker
    orig = cls._time_step
    state = {"prev": None}

    def logged(self, step, committed, seconds):
        kind = "plain" if step.plain else ("drafted" if step.drafted else ("guarded" if step.guarded else "confident"))
        with open(os.environ["STEP_LOG"], "a") as f:
            f.write(json.dumps({"bs": len(step.rids), "kind": kind, "prev": state["prev"], "s": seconds,
                                "c": committed}) + "\n")
        state["prev"] = kind
        return orig(self, step, committed, seconds)
    cls._time_step = logged

class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "sglang_graft.sglang.block_worker":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("STEP_LOG"):
    sys.meta_path.insert(0, _Hook())

"""How well the step-cost model predicts a served step's verify time: before and after it priced
context and took medians.

``record``: one GRAFT server (SmolLM2-135M float32, the committed head, the defaults) serves prompts
of one split (``--split``, ``tune`` by default: the cost model's form is a default, chosen on the
tuning split) from short categories (mt_bench, code, math) and long ones (qa, rag): first one
request at a time, then ``--concurrency`` at a time. A ``sitecustomize`` on the server's
``PYTHONPATH`` appends every ``StepCost.observe`` call (batch size, budget, draft passes, context
tokens, measured verify + draft-extend seconds) to a JSON-lines file.

``evaluate``: replays the observations in order through each candidate model, publishing every 8
observations as the engine does, and before each observation predicts its verify seconds from the
ones before it. Reported per model: the median and mean of ``|predicted - measured| / measured``,
overall, by batch context (< 512, 512-2K, >= 2K tokens, and >= 3K) and by batch size (1, > 1). Candidates:

* ``ema``: the model before this change (``engine/budget.py`` at ``--baseline-rev``: exponential
  averages, alpha 0.2, no context);
* ``newest``: ``StepCost(window=1, context_term=False)``, the newest observation of a cell;
* ``median``: ``StepCost(context_term=False)``, the median of the newest 9;
* ``median+context``: ``StepCost()``, medians of base seconds plus the fitted context slope per
  batch-size bucket (the default).

    python benchmark/studies/cost_model_fit.py record --split tune --out benchmark/out/cost_obs_tune.jsonl
    python benchmark/studies/cost_model_fit.py evaluate benchmark/out/cost_obs_tune.jsonl
    python benchmark/studies/cost_model_fit.py record --categories long_context --per-category 4 \
        --concurrency 2 --out benchmark/out/cost_obs_long.jsonl       # the long-context check

The recordings behind RESULTS.md are in ``benchmark/results/cost_observations/`` (``evaluate``
reads them gzipped).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmark/
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "models"))

OBS_ENV = "GRAFT_BENCH_COST_OBSERVATIONS"
SHIM = """
import json, os
from sglang_graft.engine import budget

_observe = budget.StepCost.observe


def _recorded(self, **kw):
    with open(os.environ["{env}"], "a") as f:
        f.write(json.dumps(kw) + "\\n")
    return _observe(self, **kw)


budget.StepCost.observe = _recorded
"""
SHORT, LONG = ("mt_bench", "code", "math"), ("qa", "rag")
PUBLISH_EVERY = 8


def record(args) -> None:
    from transformers import AutoTokenizer

    import build_smollm2
    import prompt_sets
    from local_server import SGLangServer
    from profile_verify import DEFAULT_HEAD
    from spec_bench import _encode

    model = build_smollm2.build(build_smollm2.default_dir("float32"), "float32")
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [_encode(tok, p) for cat in args.categories.split(",")
               for p in prompt_sets.load(cat, args.split, args.per_category)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as shim:
        Path(shim, "sitecustomize.py").write_text(SHIM.format(env=OBS_ENV))
        env = {OBS_ENV: str(args.out.resolve()),
               "PYTHONPATH": os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH", "")) if p)}
        flags = ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(DEFAULT_HEAD)]
        with SGLangServer(model, flags, log_path=args.out.with_suffix(".log"), env=env) as srv:
            for ids in prompts:
                srv.generate_ids(ids, args.new_tokens)
            with cf.ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(lambda ids: srv.generate_ids(ids, args.new_tokens), prompts))
    print(f"{sum(1 for _ in args.out.open())} observations -> {args.out}")


def _baseline_cost(rev: str):
    """``StepCost`` of ``engine/budget.py`` at ``rev`` (imported from ``git show``)."""
    root = HERE.parent
    text = subprocess.run(["git", "show", f"{rev}:python/sglang_graft/engine/budget.py"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "budget_baseline.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("budget_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.StepCost


def _models(baseline_rev: str, budgets: list[int]) -> dict:
    from sglang_graft.engine.budget import StepCost

    old = _baseline_cost(baseline_rev)
    return {"ema": (old(budgets), False), "newest": (StepCost(budgets, window=1, context_term=False), True),
            "median": (StepCost(budgets, context_term=False), True), "median+context": (StepCost(budgets), True)}


def _context_bucket(context: int) -> str:
    return "<512" if context < 512 else "512-2K" if context < 2048 else ">=2K"


def evaluate(args) -> dict:
    opener = gzip.open if args.observations.suffix == ".gz" else open
    with opener(args.observations, "rt") as f:
        obs = [json.loads(line) for line in f]
    budgets = sorted({o["num_nodes"] for o in obs})
    models = _models(args.baseline_rev, budgets)
    errors = {name: {} for name in models}
    for i, o in enumerate(obs):
        measured = o["verify_s"]
        if i >= args.warmup and measured > 0:
            keys = ("all", f"context {_context_bucket(o.get('context', 0))}", f"bs {'1' if o['bs'] == 1 else '>1'}",
                    *(["context >=3K"] if o.get("context", 0) >= 3072 else []))
            for name, (model, takes_context) in models.items():
                kw = {"context": o.get("context", 0)} if takes_context else {}
                predicted = model.verify_at(o["bs"], o["num_nodes"], **kw)
                for key in keys:
                    errors[name].setdefault(key, []).append(abs(predicted - measured) / measured)
        for name, (model, takes_context) in models.items():
            model.observe(**(o if takes_context else {k: v for k, v in o.items() if k != "context"}))
            if (i + 1) % PUBLISH_EVERY == 0:
                model.publish()
    report = {name: {key: {"n": len(v), "median": round(statistics.median(v), 3), "mean": round(statistics.fmean(v), 3)}
                     for key, v in sorted(by.items())} for name, by in errors.items()}
    slopes = models["median+context"][0].as_dict()["verify_s_per_context_token_by_bs"]
    return {"observations": len(obs), "warmup": args.warmup, "report": report,
            "fitted_slope_s_per_context_token_by_bs": slopes}


def render(result: dict) -> str:
    keys = list(next(iter(result["report"].values())))
    lines = ["| model | " + " | ".join(f"{k} (n {result['report']['ema'][k]['n']})" for k in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for name, by in result["report"].items():
        lines.append(f"| {name} | " + " | ".join(f"{by[k]['median']:.3f} / {by[k]['mean']:.3f}" for k in keys) + " |")
    lines.append(f"\n|error| / measured, median / mean; fitted slopes (s per context token, by batch size) "
                 f"{result['fitted_slope_s_per_context_token_by_bs']}; {result['observations']} observations")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--out", type=Path, default=HERE / "out" / "cost_obs.jsonl")
    rec.add_argument("--split", default="tune")
    rec.add_argument("--categories", default=",".join(SHORT + LONG),
                     help="prompt categories served (long_context: 3.2-6.1K-token prompts)")
    rec.add_argument("--per-category", type=int, default=4)
    rec.add_argument("--new-tokens", type=int, default=64)
    rec.add_argument("--concurrency", type=int, default=4)
    ev = sub.add_parser("evaluate")
    ev.add_argument("observations", type=Path)
    ev.add_argument("--baseline-rev", default="a212b91", help="the commit whose cost model is the 'ema' baseline")
    ev.add_argument("--warmup", type=int, default=16, help="observations before predictions are scored")
    ev.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.cmd == "record":
        record(args)
        return
    result = evaluate(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(render(result))


if __name__ == "__main__":
    main()

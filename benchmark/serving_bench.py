"""Throughput under load: ``python -m sglang.benchmark.serving`` against real servers, fully offline.

Builds a ``custom`` dataset (JSONL of conversations) from the benchmark prompts of
``prompt_sets.py`` (``--split report`` by default, every category; or ``--prompts``), starts one
server per method on 127.0.0.1 (SmolLM2-135M-Instruct in float32 by default), and runs SGLang's own
load generator at each concurrency. Output lengths are ``fixed`` (every request generates exactly
``--output-len`` tokens, EOS ignored) or ``variable`` (``--output-len-mode variable``: each request
ends at the model's end of text, at most ``--output-len`` tokens; sglang.benchmark.serving's random output
lengths exist only for its random-token datasets). Writes JSON, Markdown and a PNG of output
throughput per method and concurrency, and the ratio to no speculation. ``--steady-state RATIO`` runs
SGLang's steady-state entry point instead (``python -m sglang.benchmark.steady_state_serving``): each
level also reports the output throughput over the longest stretch with at least ``RATIO`` x the
peak concurrency in flight (ramp-up and drain left out), and its ratio to no speculation's.
Waves stay the default, measured: with fixed output lengths a server without speculation runs each
wave in lockstep, its requests end together and concurrency drops at every wave's end, so its
"longest stretch" is one wave, the slowest one (none at c=8: a 68 s window of a 418 s run, 14.9
tok/s against 19.6 over the run; GRAFT's requests end one by one and its window is 206 s of 386 s,
20.9 against 21.2; benchmark/RESULTS.md, "Steady state against waves"). Use ``--steady-state``
with ``--output-len-mode variable``, where no server runs in lockstep.

    python benchmark/serving_bench.py                      # none, EAGLE3-adaptive, GRAFT at 1 / 8 / 16 / 32
    python benchmark/serving_bench.py --output-len-mode variable
    python benchmark/serving_bench.py --interleave          # methods take turns at each level
    python benchmark/serving_bench.py --concurrency 1 4 --prompts-per-level 8 16 --methods none,GRAFT --output-len 64
    python benchmark/serving_bench.py --variant 'GRAFT-plain=GRAFT --speculative-graft-plain-steps on'
    python benchmark/serving_bench.py --steady-state 0.8    # also the steady-state throughput per level

Requests per level: several waves of the concurrency (by default 64 / 96 / 105 at 8 / 16 / 32). With
fixed output lengths the requests of a server without speculation finish in lockstep, a wave at a
time at a full batch, while a speculative server's finish one by one and its last wave drains at a
shrinking batch; at two waves per level that drain is a large part of the run, which a server under
steady traffic never sees (benchmark/RESULTS.md, "Load in waves").

``EAGLE3-adaptive`` is SGLang's ``--speculative-adaptive`` on the usual 3-step chain (its depth
follows acceptance and batch size); ``EAGLE3-chain``, ``EAGLE3-tree`` and ``NGRAM`` (SGLang's n-gram
lookup, N 16 as in spec_bench) are the static ones.
GRAFT methods add their step economy after each level (step-time breakdown, draft passes, budgets
chosen; cumulative since the server started) to the JSON and the Markdown. ``--variant NAME=BASE
ARGS`` adds method ``NAME``: ``BASE``'s flags and ``ARGS``, run after the ``--methods``; a GRAFT
variant's economy is its own server's (measured draft passes, budgets and step times).

The same load by hand, against a server you started (the command this script runs)::

    python -m sglang.benchmark.serving --backend sglang --base-url http://127.0.0.1:30000 \\
        --dataset-name custom --dataset-path benchmark/out/serving/prompts.jsonl --apply-chat-template \\
        --num-prompts 32 --sharegpt-output-len 128 --max-concurrency 16 --request-rate inf --seed 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "models"))

import build_smollm2  # noqa: E402
import prompt_sets  # noqa: E402
import requests  # noqa: E402
from plotting import pyplot  # noqa: E402
from local_server import SERVER_ENV, SGLangServer  # noqa: E402
from spec_bench import ADAPTIVE, CHAIN, PLAIN_BLOCK, block_summary, plain_block_env  # noqa: E402
from spec_report import render_block, render_economy  # noqa: E402

METHODS = {
    "none": [],
    # SGLang turns the overlap scheduler off for speculative decoding on CPU; this isolates the step
    "none-no-overlap": ["--disable-overlap-schedule"],
    "EAGLE3-tree": ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "4", "--speculative-eagle-topk",
                    "4", "--speculative-num-draft-tokens", "16"],
    "EAGLE3-chain": ["--speculative-algorithm", "EAGLE3", *CHAIN],
    "NGRAM": ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "16"],  # spec_bench's default N
    # SGLang's own adaptive speculation (candidate depths per batch size: SGLang's default config)
    "EAGLE3-adaptive": ["--speculative-algorithm", "EAGLE3", *CHAIN, *ADAPTIVE],
    "GRAFT": ["--speculative-algorithm", "GRAFT"],  # the defaults a user gets
    "GRAFT-fixed": ["--speculative-algorithm", "GRAFT", "--speculative-graft-budget-mode", "fixed"],
    # the CUDA default (no host read in the step), served on this CPU
    # the defaults as CUDA resolves them, forced on the CPU: sync-free steps (decisions from a step two
    # calls old, no ragged trees, no rate guard)
    "GRAFT-cuda": ["--speculative-algorithm", "GRAFT", "--speculative-graft-sync-free", "on"],
}
# served with --block-draft (a DFlash block draft) instead of the EAGLE-3 head: SGLang's own DFLASH and
# GRAFT's block mode (chosen by the draft's type)
BLOCK_METHODS = {
    "DFLASH": ["--speculative-algorithm", "DFLASH"],
    "GRAFT-DFlash": ["--speculative-algorithm", "GRAFT"],
}


def dataset_rows(per_category: int, split: str = "report", prompts: Path | None = None) -> list[tuple[str, str]]:
    """``(category, prompt)`` rows of the benchmark prompts, each category's together."""
    if prompts is not None:
        per_cat: dict[str, list[str]] = {}
        for c, p in prompt_sets.load_jsonl(prompts):
            per_cat.setdefault(c, []).append(p)
        return [(c, p) for c, ps in per_cat.items() for p in ps[:per_category]]
    return [(c, p) for c in prompt_sets.CATEGORIES for p in prompt_sets.load(c, split, per_category)]


def write_dataset(path: Path, rows: list[tuple[str, str]]) -> int:
    """``(category, prompt)`` rows as sglang.benchmark.serving's ``custom`` JSONL; returns their number."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _, prompt in rows:
            f.write(json.dumps({"conversations": [{"content": prompt}, {"content": "-"}]}) + "\n")
    return len(rows)


def disjoint_levels(rows: list[tuple[str, str]], sizes: list[int]) -> list[list[tuple[str, str]]]:
    """Split ``rows`` into one slice per level, ``sizes[i]`` rows each, no prompt in two slices, every
    slice mixing the categories (rows dealt round-robin over the categories first).

    Example: categories a (a1, a2, a3) and b (b1, b2), sizes [2, 3] -> [a1, b1], [a2, b2, a3]."""
    if sum(sizes) > len(rows):
        raise SystemExit(f"--disjoint-levels: the levels need {sum(sizes)} prompts, the dataset has {len(rows)}")
    per_cat: dict[str, list] = {}
    for row in rows:
        per_cat.setdefault(row[0], []).append(row)
    dealt = [rs[i] for i in range(max(map(len, per_cat.values()))) for rs in per_cat.values() if i < len(rs)]
    out, start = [], 0
    for n in sizes:
        out.append(dealt[start:start + n])
        start += n
    return out


def chat_flags(model: Path) -> list[str]:
    """sglang.benchmark.serving's ``--apply-chat-template`` where ``model``'s tokenizer has a chat template."""
    config = json.loads((Path(model) / "tokenizer_config.json").read_text())
    return ["--apply-chat-template"] if config.get("chat_template") or (Path(model) / "chat_template.jinja").exists() else []


def run_load(url: str, model: Path, dataset: Path, concurrency: int, num_prompts: int, output_len: int,
             out_file: Path, natural_eos: bool = False, steady_ratio: float | None = None) -> dict:
    """One level of load; ``natural_eos``: requests end at EOS (at most ``output_len`` tokens). Prompts
    go through the model's chat template where it has one (a base model gets the plain text).
    ``steady_ratio``: SGLang's steady-state entry point, its metrics under ``"steady"``."""
    module = "sglang.benchmark.steady_state_serving" if steady_ratio else "sglang.benchmark.serving"
    cmd = [sys.executable, "-m", module, "--backend", "sglang", "--base-url", url,
           "--tokenizer", str(model), "--dataset-name", "custom", "--dataset-path", str(dataset),
           *chat_flags(model), "--num-prompts", str(num_prompts), "--sharegpt-output-len", str(output_len),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--seed", "1",
           "--output-file", str(out_file)] + (["--disable-ignore-eos"] if natural_eos else [])
    steady_file = out_file.with_suffix(".steady.jsonl") if steady_ratio else None
    if steady_ratio:
        cmd += ["--steady-state-concurrency-ratio", str(steady_ratio), "--steady-state-output-file", str(steady_file)]
    for f in (out_file, steady_file):
        if f is not None and f.exists():
            f.unlink()  # SGLang appends to them
    env = {**os.environ, **SERVER_ENV}
    # its progress bar (requests done; a level takes minutes on a CPU) goes to our stderr as it runs
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} failed (its messages above): {proc.stdout[-2000:]}")
    return read_result(out_file, steady_file)


def read_result(out_file: Path, steady_file: Path | None = None) -> dict:
    """The run's result (SGLang writes one JSON line per run), with the steady-state entry point's
    metrics (its own file) under ``"steady"``."""
    result = json.loads(out_file.read_text().strip().splitlines()[-1])
    if steady_file is None:
        return result
    if not steady_file.exists() or not steady_file.read_text().strip():
        raise RuntimeError(f"{steady_file}: no steady-state result for the run")
    return {**result, "steady": json.loads(steady_file.read_text().strip().splitlines()[-1])}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2", choices=["smollm2", "gemma3"],
                    help="the built-in target (SmolLM2-135M-Instruct or Gemma-3-270M, built offline from its wheels, "
                    "benchmark/models/build_smollm2.py) and its committed EAGLE-3 head")
    ap.add_argument("--model", type=Path, help="target HF dir instead of --target's")
    ap.add_argument("--draft", type=Path, help="EAGLE-3 head dir (default: --target's committed head)")
    ap.add_argument("--block-draft", type=Path, help="DFlash block draft of the DFLASH and GRAFT-DFlash methods "
                    "(default: --target's committed one, if it has one)")
    ap.add_argument("--methods", default="none,EAGLE3-adaptive,GRAFT",
                    help=f"comma-separated, of {', '.join([*METHODS, *BLOCK_METHODS])}")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--prompts-per-level", type=int, nargs="+", default=[8, 64, 96, 105],
                    help="requests sent at each concurrency (one value per --concurrency; capped at the dataset's "
                         "rows); several waves per level, so that the final drain is a small part of the run")
    ap.add_argument("--split", default="report", choices=["tune", "report"],
                    help="built-in prompts (benchmark/prompt_sets.py): 'report' (default) or 'tune'")
    ap.add_argument("--prompts", type=Path, help="JSONL with category and prompt fields instead of the built-in sets")
    ap.add_argument("--prompts-per-category", type=int, default=15,
                    help="dataset rows per category (15: every category's whole split)")
    ap.add_argument("--output-len", type=int, default=128,
                    help="tokens per request (variable lengths: at most this many)")
    ap.add_argument("--output-len-mode", choices=["fixed", "variable"], default="fixed",
                    help="fixed: exactly --output-len tokens per request (EOS ignored); variable: each request "
                    "ends at the model's end of text")
    ap.add_argument("--natural-eos", action="store_true", help="the same as --output-len-mode variable")
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="KV pool of every server, in tokens (default: the test servers' 8192; the longest "
                         "benchmark prompts are ~3.7k tokens, so at concurrency 8+ the pool limits admission)")
    ap.add_argument("--interleave", action="store_true",
                    help="all servers up at once; at each concurrency the methods take turns (order rotated per "
                         "level), so drift of the machine's speed is shared (default: one server after another)")
    ap.add_argument("--steady-state", type=float, default=None, metavar="RATIO",
                    help="also measure the steady state (SGLang's steady_state_serving): output throughput over the "
                    "longest stretch with at least RATIO x the peak concurrency in flight, e.g. 0.8; with fixed "
                    "output lengths a server without speculation's stretch is its slowest wave (biased low): "
                    "use it with --output-len-mode variable")
    ap.add_argument("--disjoint-levels", action="store_true",
                    help="each concurrency level serves its own prompts (no prompt at two levels): a method with a "
                    "cache shared across requests (NGRAM) would otherwise replay outputs of earlier levels")
    ap.add_argument("--plain-block-steps", action="store_true",
                    help=f"add {PLAIN_BLOCK}: GRAFT-DFlash whose every batch step of 2+ requests verifies the roots "
                         "alone (a study of what a plain block step costs against a plain decode step)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=BASE ARGS",
                    help="another method: BASE's server flags with ARGS added (repeatable)")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "serving")
    args = ap.parse_args(argv)
    if args.draft is None:
        args.draft = build_smollm2.head_dir(args.target)
    if args.block_draft is None:
        args.block_draft = build_smollm2.block_draft_dir(args.target)
    if len(args.prompts_per_level) != len(args.concurrency):
        sys.exit("--prompts-per-level needs one value per --concurrency")
    if args.natural_eos:
        args.output_len_mode = "variable"
    if args.steady_state and args.output_len_mode == "fixed":
        print("[serving_bench] note: --steady-state with fixed output lengths: a server without speculation "
              "runs in waves and its steady window is its slowest wave; --output-len-mode variable avoids it",
              file=sys.stderr, flush=True)
    table = dict(METHODS)
    if args.block_draft is not None:
        table.update({name: [*flags, "--speculative-draft-model-path", str(args.block_draft)]
                      for name, flags in BLOCK_METHODS.items()})
    args.table = dict(table)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in table]
    if unknown:
        sys.exit(f"--methods: unknown {unknown}; choose from {', '.join(table)}")
    args.envs = {}
    if args.plain_block_steps:
        if "GRAFT-DFlash" not in table:
            sys.exit("--plain-block-steps: needs a block draft (--block-draft, or the target's committed one)")
        args.table[PLAIN_BLOCK] = table["GRAFT-DFlash"]
        args.envs[PLAIN_BLOCK] = plain_block_env(args.out / "plain_block_site")
        names.append(PLAIN_BLOCK)
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        base, *extra = rest.split()
        if not name or base not in table or name in args.table:
            sys.exit(f"--variant {spec!r}: needs NAME=BASE ARGS with a new NAME and BASE one of {', '.join(table)}")
        args.table[name] = [*table[base], *extra]
        names.append(name)
    args.names = names
    return args


def server_args(name: str, args: argparse.Namespace) -> list[str]:
    """The server flags of method ``name``."""
    extra = list(args.table[name])
    if "--speculative-algorithm" in extra and "--speculative-draft-model-path" not in extra:
        extra += ["--speculative-draft-model-path", str(args.draft)]
    extra += ["--max-running-requests", str(max(args.concurrency))]
    if args.max_total_tokens:  # after the CPU defaults: the last value counts
        extra += ["--max-total-tokens", str(args.max_total_tokens)]
    return extra


def measure_level(name: str, srv, args: argparse.Namespace, dataset: Path, conc: int, n: int,
                  economy: dict) -> dict:
    """One concurrency level on a running server: its result row; GRAFT's economy into ``economy``."""
    r = run_load(srv.url, args.model, dataset, conc, n, args.output_len, args.out / f"{name}-c{conc}.jsonl",
                 args.output_len_mode == "variable", args.steady_state)
    steady = r.get("steady")
    print(f"[serving_bench] {name} c={conc}: {r['output_throughput']:.1f} output tok/s"
          + (f", steady state {steady['output_throughput']:.1f}" if steady else ""), flush=True)
    graft = requests.get(srv.url + "/server_info", timeout=60).json()["internal_states"][0].get("graft")
    if graft and "economy" in graft:
        economy[f"{name} c={conc}"] = graft["economy"]
    block = (graft or {}).get("block")  # GRAFT's block mode (a DFlash draft): cumulative up to this level
    return {"method": name, "concurrency": conc, "num_prompts": n,
            "graft_block": block_summary(dict.fromkeys(block, 0), block) if block else None,
            "graft_block_rate_guard": (graft or {}).get("rate_guard") if block else None,  # as published at the end
            "output_len_mode": args.output_len_mode, "mean_ttft_ms": r.get("mean_ttft_ms"),
            "mean_tpot_ms": r.get("mean_tpot_ms"), "total_output_tokens": r.get("total_output_tokens"),
            "output_throughput": r["output_throughput"],
            "request_throughput": r.get("request_throughput"),
            "median_itl_ms": r.get("median_itl_ms"), "median_ttft_ms": r.get("median_ttft_ms"),
            "accept_length": r.get("accept_length"),
            "steady_output_throughput": steady["output_throughput"] if steady else None,
            "steady_s": steady["duration"] if steady else None}


def measure(names: list[str], args: argparse.Namespace, datasets: dict[int, Path]) -> tuple[list[dict], dict]:
    """Every method at every concurrency level: result rows and GRAFT's economy after each level
    (cumulative since its server started). One server after another; with ``--interleave`` all
    servers up at once (idle ones sleep) and, at each level, the methods in an order rotated by one
    per level, so that a machine slowing down over the run is shared by all methods."""
    results, economy = [], {}
    levels = list(zip(args.concurrency, args.prompts_per_level))
    if not args.interleave:
        for name in names:
            with SGLangServer(args.model, server_args(name, args), log_path=args.out / f"{name}.log",
                              env=args.envs.get(name)) as srv:
                srv.generate_ids([1, 2, 3, 4], 8)  # warm-up
                results += [measure_level(name, srv, args, datasets[c], c, n, economy) for c, n in levels]
        return results, economy
    with contextlib.ExitStack() as stack:
        servers = {}
        for name in names:
            servers[name] = stack.enter_context(
                SGLangServer(args.model, server_args(name, args), log_path=args.out / f"{name}.log",
                             env=args.envs.get(name)))
            servers[name].generate_ids([1, 2, 3, 4], 8)  # warm-up
        for i, (c, n) in enumerate(levels):
            for name in names[i % len(names):] + names[:i % len(names)]:
                results.append(measure_level(name, servers[name], args, datasets[c], c, n, economy))
    results.sort(key=lambda r: (names.index(r["method"]), r["concurrency"]))
    return results, economy


def main() -> None:
    args = parse_args()
    if args.model is None:
        args.model = build_smollm2.build_target(args.target, "float32")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = dataset_rows(args.prompts_per_category, args.split, args.prompts)
    n_rows = len(rows)
    if args.disjoint_levels:
        datasets = {}
        for c, level_rows in zip(args.concurrency, disjoint_levels(rows, args.prompts_per_level)):
            datasets[c] = args.out / f"prompts-c{c}.jsonl"
            write_dataset(datasets[c], level_rows)
    else:
        if max(args.prompts_per_level) > n_rows:  # SGLang's load generator would cap it silently
            print(f"[serving_bench] the dataset has {n_rows} prompts: --prompts-per-level capped to {n_rows}")
            args.prompts_per_level = [min(n, n_rows) for n in args.prompts_per_level]
        datasets = dict.fromkeys(args.concurrency, args.out / "prompts.jsonl")
        write_dataset(datasets[args.concurrency[0]], rows)
    t_start = time.time()
    results, economy = measure(args.names, args, datasets)
    base = {r["concurrency"]: r["output_throughput"] for r in results if r["method"] == "none"}
    steady_base = {r["concurrency"]: r["steady_output_throughput"] for r in results if r["method"] == "none"}
    for r in results:
        r["vs_none"] = r["output_throughput"] / base[r["concurrency"]] if r["concurrency"] in base else None
        sb = steady_base.get(r["concurrency"])
        r["steady_vs_none"] = r["steady_output_throughput"] / sb if sb and r["steady_output_throughput"] else None
    report = {"results": results, "economy": economy, "dataset_rows": n_rows, "disjoint_levels": args.disjoint_levels,
              "output_len": args.output_len,
              "output_len_mode": args.output_len_mode, "interleave": args.interleave,
              "split": None if args.prompts else args.split, "max_total_tokens": args.max_total_tokens or 8192,
              "wall_s": round(time.time() - t_start, 1)}
    (args.out / "serving_bench.json").write_text(json.dumps(report, indent=2))
    block = {f"{r['method']} c={r['concurrency']}": r["graft_block"] for r in results if r.get("graft_block")}
    md = render(results) + render_economy(economy).replace(", whole run;", ", cumulative up to that level;") \
        + render_block(block)
    (args.out / "serving_bench.md").write_text(md)
    print(md)
    plot(results, args.out / "serving_bench.png")


def render(results: list[dict]) -> str:
    out = _table(results, "output_throughput", "vs_none", "tok/s")
    if any(r.get("steady_output_throughput") for r in results):
        out += "\nSteady state (ramp-up and drain left out):\n\n" + _table(
            results, "steady_output_throughput", "steady_vs_none", "steady tok/s")
    return out


def _table(results: list[dict], value: str, ratio: str, unit: str) -> str:
    levels = sorted({r["concurrency"] for r in results})
    names = list(dict.fromkeys(r["method"] for r in results))
    by = {(r["method"], r["concurrency"]): r for r in results}
    lines = ["| method | " + " | ".join(f"c={c} {unit} (vs none)" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for n in names:
        cells = []
        for c in levels:
            r = by.get((n, c))
            cells.append("-" if r is None or r.get(value) is None else f"{r[value]:.1f} ({r[ratio]:.2f}x)"
                         if r.get(ratio) is not None else f"{r[value]:.1f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["method"] for r in results):
        rows = [r for r in results if r["method"] == name]
        ax.plot([r["concurrency"] for r in rows], [r["output_throughput"] for r in rows], marker="o", label=name)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

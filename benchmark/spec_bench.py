"""Spec-Bench-style benchmark of speculative decoding through the real SGLang server.

Starts one server per method on 127.0.0.1 (same model, dtype and flags otherwise), sends every
prompt of every category at batch size 1, and reports per method x category:

* ``tau``: tokens committed per target verify step, bonus included (SGLang's accept length; 1.0
  without speculation);
* ``tok_per_s`` (client wall time, prefill included) and ``speedup`` over no speculation in the
  same run; ``decode_tok_per_s`` and ``decode_speedup``: the same from the first token on (the tokens
  after the first over the server's time from the first token to the last: SGLang's
  ``e2e_latency - first_token_latency``, reported with ``--enable-metrics``, which every server runs
  with), and ``prefill_s``, the mean time to the first token;
* ``retrieval_share``: accepted draft-tree tokens proposed by retrieval only (GRAFT; None where the
  responses carry no per-request counts, i.e. ``--speculative-graft-sync-free on``);
* ``draft_passes``: draft model forward passes per step; ``verify_tokens``: tokens per verify pass.
  Measured per category wherever the server reports GRAFT's economy (every GRAFT method and
  ``--variant``); otherwise the method's own flags, and None for ``EAGLE3-adaptive``, whose depth
  SGLang chooses at run time. GRAFT methods add the step-time breakdown and the histogram of verify
  budgets (``economy`` in the JSON), and the same economy per category (``economy_by_category``:
  budget histogram, expected vs committed tokens per step, draft passes);
* ``identical``: outputs token-identical to no speculation (asserted at T = 0 in float32).

The baselines are those users pick: ``EAGLE3-tree`` (``--steps`` x ``--topk``, N verified),
``EAGLE3-chain`` (3 steps, topk 1, 4 verified), ``EAGLE3-adaptive`` (SGLang's
``--speculative-adaptive`` on that chain) and ``NGRAM``; ``EAGLE3-chain-long`` (N - 1 steps, N
verified) is the chain the earlier tables of ``benchmark/RESULTS.md`` call ``EAGLE3-chain``.

Prompts come from ``benchmark/prompt_sets.py``: ``--split report`` (default) is what RESULTS.md
reports; choose defaults and thresholds on ``--split tune``. Both are disjoint from each other and
from the ``train`` split the committed EAGLE-3 head was trained on.

Writes ``--json``, a Markdown table and PNG plots next to it.

The full run (defaults: 5 prompts per category, 128 new tokens, one server at a time) is what
``benchmark/RESULTS.md`` reports. ``--quick`` (2 prompts per category, 64 new tokens) measures two
servers side by side (``--lanes 2``) to finish in about 10 minutes on 2 cores; its assertions are the
same, its speed ratios only indicative since two methods share the CPU. ``--interleave`` starts every
method's server at once and serves each prompt on each in turn, one request at a time: on a machine
whose speed drifts (a shared one) every method meets the same stretch of it.

    python benchmark/spec_bench.py                              # full run: SmolLM2 + committed head
    python benchmark/spec_bench.py --quick                      # 2 prompts/category, 64 tokens, 2 lanes
    python benchmark/spec_bench.py --interleave --methods none,EAGLE3-adaptive,GRAFT   # methods take turns
    python benchmark/spec_bench.py --split tune --methods none,GRAFT \\
        --variant 'GRAFT-deep=GRAFT-auto --speculative-num-steps 6'   # choosing a default
    python benchmark/spec_bench.py --model DIR --draft HEAD --prompts my.jsonl --methods none,GRAFT-sam
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import requests
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "models"))

import build_smollm2  # noqa: E402
import prompt_sets  # noqa: E402
from spec_report import (  # noqa: E402
    _mean_budget, plot, render_block, render_category_economy, render_economy, render_markdown,
)



@dataclass(frozen=True)
class Method:
    name: str
    args: tuple[str, ...]
    draft_steps: int | None  # draft forward passes per step (0: no draft model; None: chosen at run time)
    needs_draft: bool = False
    verify_tokens: int | None = 1  # tokens per verify pass, root included (None: chosen at run time)


def _eagle(steps: int, topk: int, n: int) -> tuple[str, ...]:
    return ("--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(n))


CHAIN = _eagle(3, 1, 4)  # the chain users pick: 3 draft steps, 4 verified tokens
# SGLang's adaptive speculation moves a chain's depth with the measured acceptance (candidate steps
# 1 / 3 / 5 / 7 at batch 1, SGLang's default config). The decode graph is turned off because SGLang
# builds the state of each depth with a verify graph whatever the device, and a CPU has none
# (NotImplementedError in init_cuda_graph_state); a CPU server runs no decode graph anyway.
ADAPTIVE = ("--speculative-adaptive", "--disable-decode-cuda-graph")


def methods(steps: int, topk: int, n: int, block_draft: Path | None = None) -> dict[str, Method]:
    """The method table; ``block_draft``: a DFlash block draft, which adds ``DFLASH`` (SGLang's own)
    and ``GRAFT-DFlash`` (GRAFT's block mode, chosen by the draft's type), each naming that draft."""
    eagle = _eagle(steps, topk, n)
    graft = ("--speculative-algorithm", "GRAFT", *eagle)
    return {m.name: m for m in [
        Method("none", (), 0),
        Method("NGRAM", ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(n)), 0,
               verify_tokens=n),
        Method("EAGLE3-tree", ("--speculative-algorithm", "EAGLE3", *eagle), steps, True, n),
        Method("EAGLE3-chain", ("--speculative-algorithm", "EAGLE3", *CHAIN), 3, True, 4),
        Method("EAGLE3-adaptive", ("--speculative-algorithm", "EAGLE3", *CHAIN, *ADAPTIVE), None, True, None),
        # one chain as deep as the tree's verify budget: steps N-1, N tokens verified
        Method("EAGLE3-chain-long", ("--speculative-algorithm", "EAGLE3", *_eagle(n - 1, 1, n)), n - 1, True, n),
        Method("GRAFT-sam", (*graft, "--speculative-graft-source", "sam"), steps, True, n),
        Method("GRAFT-recycle", (*graft, "--speculative-graft-source", "recycle"), steps, True, n),
        Method("GRAFT-auto", (*graft, "--speculative-graft-source", "auto"), steps, True, n),
        Method("GRAFT-prune-only", (*graft, "--speculative-graft-source", "none"), steps, True, n),
        # the previous behaviour: every draft pass, N every step, the published draft / retrieval split
        Method("GRAFT-fixed", (*graft, "--speculative-graft-source", "auto", "--speculative-graft-budget-mode", "fixed"),
               steps, True, n),
        # what a user gets: only the algorithm and the head (steps 6, topk 4, N 16, cost-aware budget)
        Method("GRAFT", ("--speculative-algorithm", "GRAFT"), 6, True, 16),
        # the same defaults as CUDA resolves them, forced on the CPU: sync-free steps (decisions from a
        # step two calls old, no ragged trees, no rate guard)
        Method("GRAFT-cuda", ("--speculative-algorithm", "GRAFT", "--speculative-graft-sync-free", "on"), 6, True, 16),
        # one draft forward proposes a whole block (size: the draft config's, or --speculative-dflash-block-size)
        *([Method("DFLASH", ("--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(block_draft)),
                  1, True, None),
           Method("GRAFT-DFlash", ("--speculative-algorithm", "GRAFT", "--speculative-draft-model-path",
                                   str(block_draft)), 1, True, None)] if block_draft is not None else []),
    ]}


def _flag(args, name: str) -> str | None:
    """The value of the last ``name`` in ``args`` (the one SGLang keeps), or None."""
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == name]
    return values[-1] if values else None


def variant(table: dict[str, Method], spec: str) -> Method:
    """``NAME=BASE ARGS``: method BASE with server ARGS added. Its nominal draft passes and verify
    tokens follow its own flags (measured ones, from GRAFT's economy, replace them in the report)."""
    name, _, rest = spec.partition("=")
    base_name, *extra = rest.split()
    if base_name not in table:
        raise SystemExit(f"--variant {spec!r}: unknown base method {base_name!r}")
    base = table[base_name]
    steps, n = _flag(extra, "--speculative-num-steps"), _flag(extra, "--speculative-num-draft-tokens")
    draft_steps = int(steps) if steps is not None and base.draft_steps else base.draft_steps
    verify_tokens = int(n) if n is not None and base.verify_tokens != 1 else base.verify_tokens
    if "--speculative-adaptive" in extra:
        draft_steps = verify_tokens = None
    return Method(name, (*base.args, *extra), draft_steps, base.needs_draft, verify_tokens)


@dataclass
class Cell:
    tokens: int = 0
    verify_steps: int = 0
    seconds: float = 0.0
    decode_seconds: float = 0.0  # server time from the first token to the last
    prefill_seconds: float = 0.0  # server time to the first token
    retrieved: int = 0
    drafted: int = 0
    counted: int = 0  # responses that carried GRAFT's per-request counts
    outputs: list = field(default_factory=list)


def _encode(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt, add_special_tokens=True)["input_ids"]


def server_args(method: Method, draft: Path | None, dtype: str) -> list[str]:
    """The server flags of ``method``: its own, the ``--draft`` head unless the method names a head
    itself (a ``--variant`` comparing heads), and the dtype."""
    args = list(method.args)
    if method.needs_draft and "--speculative-draft-model-path" not in args:
        args += ["--speculative-draft-model-path", str(draft)]
    # --enable-metrics: the responses carry the time to the first token (decode-only speed)
    return args + ["--dtype", dtype, "--enable-metrics"]


class Lane:
    """One method's server serving prompts one at a time: per-category cells and, for GRAFT, the
    economy of each category (the difference of the server's cumulative counters around each prompt)."""

    def __init__(self, srv, warm_ids: list[int]) -> None:
        self.srv = srv
        self.cells: dict[str, Cell] = {}
        self.by_category: dict[str, Counter] = {}
        srv.generate_ids(warm_ids[:8], 4)  # warm-up outside the measurement
        self.economy = _economy(srv)
        self.block_at_start = _block_counters(srv)  # GRAFT's block mode: its counters and phase clocks
        self.block = None

    def serve(self, category: str, ids: list[int], max_new: int, temperature: float) -> None:
        t0 = time.perf_counter()
        r = self.srv.generate_ids(ids, max_new, temperature=temperature, ignore_eos=False)
        dt = time.perf_counter() - t0
        m = r["meta_info"]
        c = self.cells.setdefault(category, Cell())
        c.tokens += m["completion_tokens"]
        c.verify_steps += m.get("spec_verify_ct") or m["completion_tokens"]
        c.seconds += dt
        first = m.get("first_token_latency")
        if first is None or "e2e_latency" not in m:
            raise SystemExit(f"the server reported no first_token_latency / e2e_latency (started without "
                             f"--enable-metrics?): {sorted(m)}")
        c.prefill_seconds += first
        c.decode_seconds += m["e2e_latency"] - first
        c.retrieved += m.get("graft_retrieved_accepted", 0)
        c.drafted += m.get("graft_draft_accepted", 0)
        c.counted += "graft_draft_accepted" in m  # absent with --speculative-graft-sync-free on
        c.outputs.append(r["output_ids"])
        if self.economy is not None:  # outside the timed request
            after = _economy(self.srv)
            self.by_category.setdefault(category, Counter()).update(_counters(after) - _counters(self.economy))
            self.economy = after
        if self.block_at_start is not None:
            self.block = _block_counters(self.srv)

    def result(self) -> tuple[dict[str, Cell], dict | None, dict, dict | None]:
        """Per-category cells, the economy of the whole run (or None), its economy per category, and
        GRAFT's block-mode counters over the run (or None; :func:`block_summary`)."""
        block = block_summary(self.block_at_start, self.block) if self.block is not None else None
        return self.cells, self.economy, {cat: _category_economy(c) for cat, c in self.by_category.items()}, block


def run_method(method: Method, model: Path, draft: Path | None, dtype: str, prompts, max_new: int,
               temperature: float, log_dir: Path) -> tuple[dict[str, Cell], dict | None, dict]:
    """Serve ``prompts`` one at a time on ``method``'s server (see :class:`Lane`)."""
    from local_server import SGLangServer

    with SGLangServer(model, server_args(method, draft, dtype), log_path=log_dir / f"{method.name}.log") as srv:
        lane = Lane(srv, prompts[0][2])
        for category, _, ids in prompts:
            lane.serve(category, ids, max_new, temperature)
    return lane.result()


def run_interleaved(names: list[str], table: dict[str, Method], model: Path, draft: Path | None, dtype: str,
                    prompts, max_new: int, temperature: float, log_dir: Path) -> dict[str, tuple]:
    """Every method's server up at once (idle ones sleep), each prompt served by each in turn, the
    order rotating from prompt to prompt: a machine whose speed drifts moves every method alike,
    where one server after another hands each method a different stretch of it."""
    from local_server import SGLangServer

    with contextlib.ExitStack() as stack:
        lanes = {}
        for name in names:
            srv = stack.enter_context(SGLangServer(model, server_args(table[name], draft, dtype),
                                                   log_path=log_dir / f"{name}.log"))
            lanes[name] = Lane(srv, prompts[0][2])
        print(f"[spec_bench] {len(names)} servers up; {len(prompts)} prompts x {len(names)} methods", flush=True)
        from tqdm import tqdm

        for i, (category, _, ids) in enumerate(tqdm(prompts, desc="[spec_bench] prompts", unit="prompt",
                                                     mininterval=10, file=sys.stdout)):
            for name in names[i % len(names):] + names[: i % len(names)]:
                lanes[name].serve(category, ids, max_new, temperature)
        return {name: lane.result() for name, lane in lanes.items()}


def _economy(srv) -> dict | None:
    """GRAFT's cumulative step economy from ``/server_info`` (None for other methods), with the
    graph report (``graph``) where the server captured graphs (``--speculative-graft-graph``)."""
    info = requests.get(srv.url + "/server_info", timeout=60).json()["internal_states"][0]
    graft = info.get("graft") or {}
    economy = graft.get("economy")
    if economy is not None and (graft.get("graph") or {}).get("captured"):
        economy = {**economy, "graph": graft["graph"]}
    return economy


def _block_counters(srv) -> dict | None:
    """GRAFT's block-mode counters (a DFlash draft) from ``/server_info``, or None for other methods."""
    info = requests.get(srv.url + "/server_info", timeout=60).json()["internal_states"][0]
    return (info.get("graft") or {}).get("block")


PLAIN_BLOCK = "GRAFT-DFlash-plain"  # a study's method: GRAFT-DFlash whose batch steps verify the roots alone
_PLAIN_BLOCK_SITE = """from sglang_graft.engine.rate_guard import RateGuard
RateGuard.speculation_loses = lambda self, bs: True
RateGuard.plain_now = lambda self, bs: True
"""


def plain_block_env(directory: Path) -> dict:
    """Environment entries of a :data:`PLAIN_BLOCK` server: a ``sitecustomize`` (written to
    ``directory``) makes every rate guard judge speculation lost, probes included, so each batch step
    of two or more requests is plain (the roots alone, where the CPU default cuts blocks) and a
    single request's step holds retrieval's chains without the draft: a plain block step set beside
    a plain decode step."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_PLAIN_BLOCK_SITE)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)}


def block_summary(before: dict, after: dict) -> dict:
    """The block mode over a run: draft tokens kept, slots grafted and block rows verified per
    request-step (a server without the rows counter: every row), the share of batch steps that ran no
    draft forward (retrieval's chains alone), and the host milliseconds per batch step of each phase
    (draft forward, pick + prune + graft, verify, feed); of them the plain ones (the roots alone, by
    the plain rate guard)."""
    d = {k: after.get(k, 0) - before.get(k, 0)
         for k in ("steps", "pruned_steps", "kept_tokens", "grafted_tokens", "verified_rows", "batch_steps",
                   "undrafted_batch_steps", "plain_batch_steps", "draft_s", "graft_s", "verify_s", "feed_s")}
    if "verified_rows" not in after:
        d["verified_rows"] = d["steps"] * after["block_size"]
    steps, batch_steps = max(d["steps"], 1), max(d["batch_steps"], 1)
    return {"block_size": after["block_size"], "request_steps": d["steps"], "pruned_share": d["pruned_steps"] / steps,
            "kept_per_step": d["kept_tokens"] / steps, "grafted_per_step": d["grafted_tokens"] / steps,
            "verified_rows_per_step": d["verified_rows"] / steps,
            "undrafted_share": d["undrafted_batch_steps"] / batch_steps,
            "plain_share": d["plain_batch_steps"] / batch_steps,
            "phase_ms_per_step": {p: 1e3 * d[f"{p}_s"] / batch_steps for p in ("draft", "graft", "verify", "feed")}}


def _counters(eco: dict) -> Counter:
    """The additive counters of a cumulative economy: steps, draft passes, steps per verify budget
    (``N=k``), and the expected and committed tokens of the cost-aware steps whose outcome is known."""
    check = eco.get("expected_vs_committed") or {}
    checked = check.get("steps", 0)
    return Counter({"steps": eco["steps"], "draft_passes": eco["draft_passes"],
                    "skipped_drafts": eco["skipped_drafts"], "plain_steps": eco.get("plain_steps", 0),
                    "checked_steps": checked,
                    "expected_tokens": check.get("expected_per_step", 0.0) * checked,
                    "committed_tokens": check.get("committed_per_step", 0.0) * checked,
                    **{f"N={k}": v for k, v in eco["budget_histogram"].items()}})


def _category_economy(counts: Counter) -> dict:
    """Counters summed over a category's prompts, in the shape of the server's economy (plus the
    expected and committed token totals)."""
    steps, checked = counts["steps"], counts["checked_steps"]
    hist = sorted((int(k[2:]), v) for k, v in counts.items() if k.startswith("N=") and v)
    committed = round(counts["committed_tokens"])  # an integer count, read back as mean x steps
    return {"steps": steps, "draft_passes": counts["draft_passes"],
            "mean_draft_passes": counts["draft_passes"] / steps if steps else 0.0,
            "skipped_drafts": counts["skipped_drafts"], "plain_steps": counts["plain_steps"],
            "budget_histogram": {str(k): v for k, v in hist},
            "expected_vs_committed": {
                "steps": checked, "expected_tokens": round(counts["expected_tokens"], 3),
                "committed_tokens": committed,
                "expected_per_step": counts["expected_tokens"] / checked if checked else 0.0,
                "committed_per_step": committed / checked if checked else 0.0}}


DEFAULT_METHODS = ("none,NGRAM,EAGLE3-tree,EAGLE3-chain,EAGLE3-adaptive,GRAFT,GRAFT-sam,GRAFT-recycle,GRAFT-auto,"
                   "GRAFT-prune-only,GRAFT-fixed")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2", choices=["smollm2", "gemma3"],
                    help="the built-in target (SmolLM2-135M-Instruct or Gemma-3-270M, built offline from its wheels, "
                    "benchmark/models/build_smollm2.py) and its committed EAGLE-3 head")
    ap.add_argument("--model", type=Path, help="target HF dir instead of --target's")
    ap.add_argument("--draft", type=Path, help="EAGLE-3 head dir (default: --target's committed head)")
    ap.add_argument("--block-draft", type=Path, help="DFlash block draft of the DFLASH and GRAFT-DFlash methods "
                    "(default: --target's committed one, if it has one)")
    ap.add_argument("--prompts", type=Path, help="JSONL with category and prompt fields (default: built-in sets)")
    ap.add_argument("--split", default="report", choices=["tune", "report"],
                    help="built-in prompts to serve: 'report' (default; what RESULTS.md reports) or 'tune' (where "
                    "defaults and thresholds are chosen); disjoint from each other and from the draft head's "
                    "'train' split (benchmark/prompt_sets.py); ignored with --prompts")
    ap.add_argument("--categories", default=",".join(prompt_sets.CATEGORIES))
    ap.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated; also EAGLE3-chain-long (one "
                    "chain N-1 steps deep, N verified)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=BASE ARGS",
                    help="an extra method: BASE (a method name) with server ARGS added, e.g. "
                    "'recycle-shared=GRAFT-recycle --speculative-graft-recycle-scope shared'; repeatable")
    ap.add_argument("--num-prompts", type=int, help="prompts per category (default 5; 2 with --quick)")
    ap.add_argument("--max-new-tokens", type=int, help="default 128; 64 with --quick")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 (greedy, outputs asserted identical in float32) or e.g. 1; note that on a CPU SGLang "
                    "verifies EAGLE3 / NGRAM sampling requests greedily, while GRAFT samples")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--num-draft-tokens", type=int, default=16, help="verify budget N (root included)")
    ap.add_argument("--quick", action="store_true", help="2 prompts per category, 64 new tokens, 2 lanes "
                    "(each unless given explicitly)")
    ap.add_argument("--lanes", type=int, help="servers measured at the same time (default 1; 2 with --quick: "
                    "fits 10 minutes on 2 cores, but then methods share the CPU and speed ratios are indicative)")
    ap.add_argument("--interleave", action="store_true", help="every server up at once, each prompt served by "
                    "each method in turn (one request at a time): ratios robust to a machine whose speed drifts")
    ap.add_argument("--json", type=Path, default=HERE / "out" / "spec_bench.json")
    args = ap.parse_args(argv)
    if args.draft is None:
        args.draft = build_smollm2.head_dir(args.target)
    if args.block_draft is None:
        args.block_draft = build_smollm2.block_draft_dir(args.target)
    if args.num_prompts is None:
        args.num_prompts = 2 if args.quick else 5
    if args.max_new_tokens is None:
        args.max_new_tokens = 64 if args.quick else 128
    if args.lanes is None:
        args.lanes = 2 if args.quick else 1
    if args.lanes < 1:
        sys.exit("--lanes must be >= 1")
    if args.interleave and args.lanes > 1:
        sys.exit("--interleave serves one request at a time: it takes no --lanes")
    return args


def choose_methods(args: argparse.Namespace) -> tuple[dict[str, Method], list[str]]:
    """The method table (``--variant`` entries added) and the methods to run, ``none`` first."""
    table = methods(args.steps, args.topk, args.num_draft_tokens, args.block_draft)
    for spec in args.variant:
        m = variant(table, spec)
        table[m.name] = m
        if m.name not in args.methods.split(","):
            args.methods += "," + m.name
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in table]
    if unknown:
        sys.exit(f"--methods: unknown {unknown}; choose from {', '.join(table)}")
    if "none" not in chosen:
        chosen.insert(0, "none")  # the baseline of speedup and identity
    if any(table[m].needs_draft for m in chosen) and not (args.draft / "config.json").exists():
        sys.exit(f"--draft {args.draft} has no config.json (train one with benchmark/train_eagle3.py)")
    return table, chosen


def load_prompts(args: argparse.Namespace, tokenizer) -> list[tuple[str, str, list[int]]]:
    """``(category, prompt, ids)``, each category's prompts together."""
    if args.prompts:
        per_cat: dict[str, list[str]] = {}
        for c, p in prompt_sets.load_jsonl(args.prompts):
            per_cat.setdefault(c, []).append(p)
        rows = [(c, p) for c, ps in per_cat.items() for p in ps[: args.num_prompts]]
    else:
        rows = [(c, p) for c in args.categories.split(",")
                for p in prompt_sets.load(c, args.split, args.num_prompts)]
    return [(c, p, _encode(tokenizer, p)) for c, p in rows]


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    if args.model is None:
        args.model = build_smollm2.build_target(args.target, args.dtype)
    table, chosen = choose_methods(args)
    prompts = load_prompts(args, AutoTokenizer.from_pretrained(args.model))

    out_dir = args.json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = out_dir / "server-logs"
    log_dir.mkdir(exist_ok=True)
    t_start = time.time()
    def measure(name: str):
        t0 = time.time()
        out = run_method(table[name], args.model, args.draft, args.dtype, prompts, args.max_new_tokens,
                         args.temperature, log_dir)
        print(f"[spec_bench] {name}: {len(prompts)} prompts in {time.time() - t0:.0f} s (server start included)",
              flush=True)
        return out

    if args.interleave:
        runs = run_interleaved(chosen, table, args.model, args.draft, args.dtype, prompts, args.max_new_tokens,
                               args.temperature, log_dir)
        print(f"[spec_bench] {len(chosen)} methods interleaved, {len(prompts)} prompts each, "
              f"{time.time() - t_start:.0f} s", flush=True)
    else:
        with ThreadPoolExecutor(max_workers=args.lanes) as pool:  # each lane: one server, batch size 1
            runs = dict(zip(chosen, pool.map(measure, chosen)))
    measured = {name: cells for name, (cells, *_) in runs.items()}
    economy = {name: eco for name, (_, eco, *_) in runs.items() if eco}
    by_category = {name: cats for name, (_, eco, cats, _) in runs.items() if eco}
    block = {name: b for name, (*_, b) in runs.items() if b}
    results = result_rows(chosen, measured, table, economy, by_category)
    report = {"results": results, "economy": economy, "economy_by_category": by_category, "block": block,
              "config": {k: _portable(v) for k, v in vars(args).items()}, "wall_s": round(time.time() - t_start, 1)}
    args.json.write_text(json.dumps(report, indent=2))
    md = render_markdown(results) + render_economy(economy) + render_category_economy(by_category) + render_block(block)
    args.json.with_suffix(".md").write_text(md)
    print(md)
    plot(results, args.json.with_suffix(".png"))
    if args.temperature == 0 and args.dtype == "float32":
        bad = [(r["method"], r["category"]) for r in results if not r["identical"]]
        if bad:
            sys.exit(f"outputs differ from no speculation at T=0 in float32: {bad}")


def _portable(value) -> str:
    """Config values for the report; paths relative to the checkout or to ``~``, else the file's name
    alone, so results name no machine's paths."""
    if not isinstance(value, Path):
        return str(value)
    path = value.resolve()
    for base, label in ((HERE.parent, ""), (Path.home(), "~/")):
        if path.is_relative_to(base):
            return label + str(path.relative_to(base))
    return path.name


def result_rows(chosen: list[str], measured: dict, table: dict[str, Method], economy: dict,
                by_category: dict) -> list[dict]:
    """One row per method x category. Draft passes and verify tokens are measured where the server
    reports GRAFT's economy (per category, the draft extend counted as one pass), nominal otherwise
    (the method's own flags; None where SGLang chooses them at run time, i.e. adaptive speculation)."""
    base = measured["none"]
    results = []
    for name in chosen:
        for cat, c in measured[name].items():
            b = base[cat]
            tps = c.tokens / c.seconds
            decode_tps = _decode_tok_per_s(c)
            drafted = c.retrieved + c.drafted
            eco = by_category.get(name, {}).get(cat) or {}
            eco = eco if eco.get("steps") else economy.get(name)
            results.append({
                "method": name, "category": cat, "prompts": len(c.outputs),
                "tau": c.tokens / c.verify_steps if name != "none" else 1.0,
                "tok_per_s": tps, "speedup": tps / (b.tokens / b.seconds),
                "decode_tok_per_s": decode_tps, "decode_speedup": decode_tps / _decode_tok_per_s(b),
                "prefill_s": c.prefill_seconds / len(c.outputs),
                "retrieval_share": (c.retrieved / drafted if drafted else 0.0) if c.counted or name not in economy
                else None,
                "draft_passes": 1 + eco["mean_draft_passes"] if eco else table[name].draft_steps,
                "verify_tokens": _mean_budget(eco) if eco else table[name].verify_tokens,
                "measured_economy": bool(eco),
                "identical": c.outputs == b.outputs, "tokens": c.tokens,
            })
    return results


def _decode_tok_per_s(c: Cell) -> float:
    """Tokens after the first per second of the server's time after the first token (the first token
    comes from prefill)."""
    return (c.tokens - len(c.outputs)) / c.decode_seconds if c.decode_seconds > 0 else float("nan")


if __name__ == "__main__":
    main()

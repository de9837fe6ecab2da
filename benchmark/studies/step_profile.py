"""Where a decode step's time goes, per method, sampled while the methods take turns.

Every method's server is up at once (idle ones sleep, ``--sleep-on-idle``) and ``py-spy record``
samples each for the whole run; each prompt is served by each method in turn, one request at a
time (batch 1), so a machine whose speed drifts moves every method alike. The samples of each
server are sorted by what they were inside of, and reported as milliseconds per decode step
(samples x sampling interval / decode steps; a step commits ``tau`` tokens), and per decoded token:

* ``prefill``: the prompt's forward (and the draft's, for the speculative methods);
* ``target forward`` (a verify's for the speculative methods, a decode's for ``none``), split into
  its ``linear`` layers (the CPU port's small-row kernels, lm_head included), ``attention`` and the
  rest (norms, rotary, activation, logits bookkeeping);
* ``draft forward``: the draft model's passes and its extend over the committed tokens;
* ``step logic``: everything else of a decode step (retrieval, tree, acceptance, KV moves,
  SGLang's batch preparation and GRAFT's feed);
* ``idle and other processes`` (in the JSON only): samples outside a batch (waits between turns, the
  HTTP and detokenizer processes).

py-spy itself takes CPU time (on a 2-core host, from the servers it samples), and Python-heavy parts
slow the most, so the table says where time goes, not how fast a method runs: ``spec_bench.py``
says that. Its sampling rate is ``--rate``.

Block drafts (``DFLASH``, ``GRAFT-DFlash``: ``--block-draft``, by default the target's committed
one) run their whole step inside the DFlash worker's ``forward_batch_generation``; their samples
are sorted by where that frame is: before the prefill branch returns (``prefill``), in the target's
verify (``linear``, ``attention``, ``forward rest``), in the draft model's forward and the block's
pick through the lm_head (``draft forward``), in the target's hidden states appended to the draft
KV (``draft KV append``), elsewhere (``step logic``: retrieval, pruning, acceptance, bookkeeping).
``--plain-block-steps`` adds ``GRAFT-DFlash-plain``, whose every batch step of two or more requests
verifies the roots alone (``spec_bench.plain_block_env``), to set a plain block step beside a plain
decode step.

With ``--concurrency C`` each method serves all prompts at once, ``C`` requests in flight, before the
next method takes its turn (the servers admit ``C`` requests and hold ``--max-total-tokens`` of KV, as
``serving_bench.py`` does); a decode step then serves a batch, so only the ms per decoded token
(``ms_per_token``) compares methods; ``ms_per_step`` is per request's step there.

    OMP_NUM_THREADS=1 python benchmark/studies/step_profile.py --split tune --num-prompts 2 --json out/step_profile.json
    OMP_NUM_THREADS=1 python benchmark/studies/step_profile.py --split tune --num-prompts 2 --concurrency 8 \
        --json out/step_profile_c8.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmark/
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "models"))

import build_smollm2  # noqa: E402
import prompt_sets  # noqa: E402
import spec_bench  # noqa: E402

PARTS = ("prefill", "linear", "attention", "forward rest", "draft forward", "draft KV append", "step logic",
         "idle and other processes")
STEP = ("linear", "attention", "forward rest", "draft forward", "draft KV append", "step logic")  # a decode step's parts
BLOCK_PREFIXES = ("DFLASH", "GRAFT-DFlash")  # methods drafting with a DFlash block draft
DFLASH_FILE = "dflash_worker_v2.py"


def _prefill_end_line() -> int:
    """The line of SGLang's DFlash ``forward_batch_generation`` where its prefill branch ends (the
    prefill's next draft input is made): frames of that function at or above it are a prefill's."""
    import inspect

    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    lines, first = inspect.getsourcelines(DFlashWorkerV2.forward_batch_generation)
    return first + next(i for i, line in enumerate(lines) if "_make_next_draft_input_prefill(" in line)


def classify_block(frames: list[str], prefill_end: int, method: str) -> str:
    """:func:`classify` for a block draft's server; ``frames`` keep their line (``file.py:func:line``).
    The pick (the lm_head over the block) is SGLang's ``_greedy_sample_from_vocab_parallel_head`` in
    DFLASH; GRAFT's override calls ``block_pick.greedy_with_confidence``, the rest of it is step logic."""
    stack = ";".join(frames)
    if "run_batch" not in stack:
        return "idle and other processes"
    step = [f for f in frames if f.startswith(f"{DFLASH_FILE}:") and "forward_batch_generation:" in f]
    if not step:
        return "step logic"
    if int(step[-1].rsplit(":", 1)[1]) <= prefill_end:
        return "prefill"
    if "_append_target_hidden" in stack:
        return "draft KV append"
    if "ModelRunner.forward" in stack:
        if "TpModelWorker.forward_batch_generation" not in stack:
            return "draft forward"
        if "linear.py:_product" in stack:
            return "linear"
        return "attention" if "RadixAttention.forward" in stack else "forward rest"
    sglang_pick = method.startswith("DFLASH") and "_greedy_sample_from_vocab_parallel_head" in stack
    if "block_pick.py:greedy_with_confidence" in stack or sglang_pick:
        return "draft forward"
    return "step logic"


def classify(frames: list[str], method: str) -> str:
    """The part of :data:`PARTS` a sample (its stack, outermost frame first) belongs to."""
    stack = ";".join(frames)
    if "run_batch" not in stack:  # the scheduler between batches, the HTTP and detokenizer processes
        return "idle and other processes"
    if "_forward_prefill_batch" in stack or (method == "none" and "_execute_extend" in stack):
        return "prefill"
    if "ModelRunner.forward" not in stack:
        return "step logic"
    target = "run_eagle_verify" in stack or method == "none"
    if not target:
        return "draft forward"
    if "linear.py:_product" in stack:
        return "linear"
    if "RadixAttention.forward" in stack:
        return "attention"
    return "forward rest"


def _frame(f: str, line: bool = False) -> str:
    """``func (path:line)`` -> ``file.py:func`` (py-spy's raw format), ``file.py:func:line`` with ``line``."""
    f = f.strip()
    func, _, where = f.partition(" (")
    if not where:
        return f
    path, _, number = where.rstrip(")").rpartition(":")
    return f"{Path(path).name}:{func}" + (f":{number}" if line else "")


def parts(raw: Path, method: str) -> Counter:
    block = method.startswith(BLOCK_PREFIXES)
    prefill_end = _prefill_end_line() if block else 0
    out = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            frames = [_frame(f, line=block) for f in stack.split(";")]
            out[classify_block(frames, prefill_end, method) if block else classify(frames, method)] += int(count)
    return out


class Spy:
    """``py-spy record`` of a server and its children until the block ends (SIGINT makes it write)."""

    def __init__(self, binary: str, pid: int, out: Path, rate: int) -> None:
        self.cmd = [binary, "record", "--pid", str(pid), "--subprocesses", "--format", "raw", "--rate", str(rate),
                    "--nonblocking", "-o", str(out)]
        self.proc = None

    def __enter__(self):
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=120)
        return False


def render(report: dict) -> str:
    """The markdown table of a report: ms per decode step by part, and the decode step's sum."""
    cols = ("prefill",) + STEP
    lines = []
    for unit in ("ms_per_step", "ms_per_token"):
        lines += [f"{unit.replace('_', ' ')}:", "",
                  "| method | tokens / step | " + " | ".join(cols) + " | decode |", "|---|---|" + "---|" * (len(cols) + 1)]
        for name, m in report["methods"].items():
            ms = m[unit]
            lines.append(f"| {name} | {m['tokens_per_step']} | " + " | ".join(str(ms[p]) for p in cols)
                         + f" | {sum(ms[p] for p in STEP):.1f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2", choices=["smollm2", "gemma3"])
    ap.add_argument("--methods", default="none,GRAFT")
    ap.add_argument("--split", default="tune", choices=["tune", "report"])
    ap.add_argument("--num-prompts", type=int, default=2, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests in flight; above 1 each method serves every prompt at once in its turn")
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool with --concurrency above 1")
    ap.add_argument("--py-spy", dest="spy", default=str(Path(sys.executable).with_name("py-spy")),
                    help="py-spy binary (default: beside this Python, scripts/install_bench.sh installs it)")
    ap.add_argument("--block-draft", type=Path, help="DFlash block draft of DFLASH and GRAFT-DFlash (default: the "
                    "target's committed one)")
    ap.add_argument("--plain-block-steps", action="store_true",
                    help="add GRAFT-DFlash-plain: every batch step of 2+ requests verifies the roots alone")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=BASE ARGS",
                    help="a method with server flags added (as spec_bench.py's)")
    ap.add_argument("--json", type=Path, default=HERE / "out" / "step_profile.json")
    args = ap.parse_args()
    from local_server import SGLangServer
    from transformers import AutoTokenizer

    model = build_smollm2.build_target(args.target, "float32")
    draft = build_smollm2.head_dir(args.target)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [(c, spec_bench._encode(tokenizer, p)) for c in prompt_sets.CATEGORIES
               for p in prompt_sets.load(c, args.split, args.num_prompts)]
    shape = spec_bench.parse_args([])  # spec_bench's draft shape of the explicit-shape methods
    table = spec_bench.methods(shape.steps, shape.topk, shape.num_draft_tokens,
                               args.block_draft or build_smollm2.block_draft_dir(args.target))
    for spec in args.variant:
        m = spec_bench.variant(table, spec)
        table[m.name] = m
    names = args.methods.split(",")
    out_dir = args.json.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    envs = {}
    if args.plain_block_steps:
        table[spec_bench.PLAIN_BLOCK] = table["GRAFT-DFlash"]
        names.append(spec_bench.PLAIN_BLOCK)
        envs[spec_bench.PLAIN_BLOCK] = spec_bench.plain_block_env(out_dir / "plain_block_site")
    tokens = {n: [0, 0, 0] for n in names}  # completion tokens, requests, decode steps
    counting = threading.Lock()
    load = [] if args.concurrency == 1 else ["--max-running-requests", str(args.concurrency),
                                             "--max-total-tokens", str(args.max_total_tokens)]

    def serve(name: str, ids: list[int]) -> None:
        meta = servers[name].generate_ids(ids, args.max_new_tokens, temperature=0.0, ignore_eos=False)["meta_info"]
        # speculative methods: verify steps; none: a step per token after the prefill's
        steps = meta.get("spec_verify_ct") or meta["completion_tokens"] - 1
        with counting:
            for i, n in enumerate((meta["completion_tokens"], 1, steps)):
                tokens[name][i] += n

    with contextlib.ExitStack() as running:
        servers = {}
        for name in names:
            servers[name] = srv = running.enter_context(SGLangServer(
                model, spec_bench.server_args(table[name], draft, "float32") + load,
                log_path=out_dir / f"step_profile-{name}.log", env=envs.get(name)))
            srv.generate_ids(prompts[0][1][:8], 4)  # warm-up, outside the samples
        with contextlib.ExitStack() as sampled:
            for n, srv in servers.items():
                sampled.enter_context(Spy(args.spy, srv.proc.pid, out_dir / f"step_profile-{n}.raw", args.rate))
            if args.concurrency == 1:
                for i, (_, ids) in enumerate(prompts):
                    for name in names[i % len(names):] + names[: i % len(names)]:
                        serve(name, ids)
            else:
                for name in names:
                    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                        list(pool.map(lambda ids, name=name: serve(name, ids), [ids for _, ids in prompts]))
    report = {"config": {k: str(v) for k, v in vars(args).items() if k not in ("json", "spy")}, "methods": {}}
    for name in names:
        decoded, steps = tokens[name][0] - tokens[name][1], tokens[name][2]  # a request's first token: its prefill
        counts = parts(out_dir / f"step_profile-{name}.raw", name)
        ms = {p: round(counts[p] * 1e3 / args.rate / steps, 2) for p in PARTS}
        per_token = {p: round(counts[p] * 1e3 / args.rate / decoded, 2) for p in PARTS}
        report["methods"][name] = {"decode_steps": steps, "tokens": tokens[name][0],
                                   "tokens_per_step": round(decoded / steps, 3), "ms_per_step": ms,
                                   "ms_per_token": per_token}
    args.json.write_text(json.dumps(report, indent=1))
    md = render(report)
    args.json.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

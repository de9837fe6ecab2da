"""A verify step against a decode step, side by side: every server up at once, requests interleaved.

``profile_verify.py`` serves one server at a time, so a machine whose speed drifts between servers
(shared CPUs do) moves the ratios it reports. Here a plain server and one GRAFT server per budget
``N`` (``--budgets``; the fixed-``N`` servers of ``profile_verify.graft_args``) are started together
and idle between requests (``--sleep-on-idle``); each round sends the short and the long prompt to
each server in turn, one request at a time. Per server and context, the median over ``--rounds`` of

* ``step_ms``: client time per decode step (the time of ``1 + K`` new tokens less that of 1, over
  the steps the server ran: ``K`` for the plain server, GRAFT's step count from ``/server_info``);
* ``verify_ms`` (GRAFT): the verify phase of GRAFT's step timer per step (target forward,
  acceptance, commit).

``--plain-steps`` adds a GRAFT server with the cost-aware defaults whose every decode step is plain
(the root verified alone, no retrieval, draft or tree): a ``sitecustomize`` on its ``PYTHONPATH``
prices speculation out (a verified node costs 10 s) and turns off exploring steps and probes, so
after the first step (which explores ``N = 1``) the server measures what a plain step costs against
a decode step; its plain-step count is reported beside.

    python benchmark/studies/verify_vs_decode.py --budgets 2 4 8 --rounds 3 --json out/verify_vs_decode.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmark/
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "models"))

import requests  # noqa: E402
from local_server import SGLangServer  # noqa: E402
from profile_verify import DEFAULT_HEAD, graft_args, prompts, step_time, timed  # noqa: E402


# Every decode step plain: speculation priced out, no exploring step (benchmark only).
PLAIN_SHIM = """
from sglang_graft.engine import budget, step

_step = budget.StepCost.step


def _priced_out(self, *, bs, num_nodes, passes, plain=False, context=0):
    return (_step(self, bs=bs, num_nodes=num_nodes, passes=passes, plain=plain, context=context)
            + 10.0 * (num_nodes - 1 + passes))


budget.StepCost.step = _priced_out
step.GraftStepper.EXPLORE_EVERY = 10 ** 9
"""


def plain_steps_env(directory: Path) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(PLAIN_SHIM)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)}


def measure(servers: dict, ids: dict, new: int, rounds: int) -> dict:
    """``{context: {server: {"step_ms", "verify_ms"?}}}``, medians over ``rounds``."""
    steps = {ctx: {name: [] for name in servers} for ctx in ids}
    verify = {ctx: {name: [] for name in servers} for ctx in ids}
    for _ in range(rounds):
        for ctx, prompt in ids.items():
            for name, srv in servers.items():
                one = timed(srv, prompt, 1)
                if name == "plain":
                    steps[ctx][name].append(1e3 * (timed(srv, prompt, 1 + new) - one) / new)
                    continue
                before = step_time(srv)
                many = timed(srv, prompt, 1 + new)
                after = step_time(srv)
                n = max(after["steps"] - before["steps"], 1)
                steps[ctx][name].append(1e3 * (many - one) / n)
                verify[ctx][name].append(1e3 * (after["phase_s"]["verify"] - before["phase_s"]["verify"]) / n)
    return {ctx: {name: {"step_ms": round(statistics.median(steps[ctx][name]), 1),
                         **({"verify_ms": round(statistics.median(verify[ctx][name]), 1)} if verify[ctx][name] else {})}
                  for name in servers} for ctx in ids}


def render(report: dict, lengths: dict) -> str:
    lines = ["| context | plain decode ms | N | GRAFT step ms (/ decode) | verify ms (/ decode) |", "|---|---|---|---|---|"]
    for ctx, row in report.items():
        if ctx not in lengths:
            continue
        decode = row["plain"]["step_ms"]
        for name, r in row.items():
            if name == "plain":
                continue
            n = name[1:] if name.startswith("N") else name
            lines.append(f"| {ctx} ({lengths[ctx]} tok) | {decode} | {n} | {r['step_ms']} ({r['step_ms'] / decode:.2f}x) | "
                         f"{r['verify_ms']} ({r['verify_ms'] / decode:.2f}x) |")
    if "plain_steps_economy" in report:
        lines.append(f"\nplain-steps server: {json.dumps(report['plain_steps_economy'])}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="target HF dir (default: SmolLM2-135M-Instruct, built offline)")
    ap.add_argument("--draft", type=Path, default=DEFAULT_HEAD)
    ap.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--plain-steps", action="store_true", help="add a GRAFT server whose every step is plain")
    ap.add_argument("--json", type=Path, default=HERE / "out" / "verify_vs_decode.json")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    import build_smollm2

    model = args.model or build_smollm2.build(build_smollm2.default_dir("float32"), "float32")
    ids = prompts(AutoTokenizer.from_pretrained(model), args.long_tokens)
    logs = args.json.parent / "verify_vs_decode_logs"
    logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        servers = {"plain": stack.enter_context(SGLangServer(model, [], log_path=logs / "plain.log"))}
        for n in args.budgets:
            servers[f"N{n}"] = stack.enter_context(
                SGLangServer(model, graft_args(args.draft, n), log_path=logs / f"graft-N{n}.log"))
        if args.plain_steps:
            servers["plain-steps"] = stack.enter_context(SGLangServer(
                model, ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(args.draft)],
                log_path=logs / "graft-plain-steps.log", env=plain_steps_env(logs / "plain-steps-shim")))
        for srv in servers.values():
            srv.generate_ids(ids["short"][:8], 4)  # warm up
        report = measure(servers, ids, args.new_tokens, args.rounds)
        if args.plain_steps:
            economy = requests.get(servers["plain-steps"].url + "/server_info", timeout=60).json()[
                "internal_states"][0]["graft"]["economy"]
            report["plain_steps_economy"] = {k: economy[k] for k in ("steps", "plain_steps", "budget_histogram")}
    lengths = {ctx: len(p) for ctx, p in ids.items()}
    args.json.write_text(json.dumps({"report": report, "prompt_tokens": lengths, "rounds": args.rounds,
                                     "new_tokens": args.new_tokens}, indent=1))
    print(render(report, lengths))


if __name__ == "__main__":
    main()

"""Where a verify step's time goes: GRAFT's fixed-N step against a plain decode step, side by side.

For each verify budget ``N`` (``--budgets``) one GRAFT server verifies an ``N``-node draft tree at
every step (``--speculative-graft-budget-mode fixed``, draft only, checkpoints that never prune),
and one plain server decodes; both serve a short and a long prompt at batch 1 (float32). Reported
per ``N`` and context: GRAFT's step phases (``draft``, ``retrieval``, ``tree``, ``verify``,
``draft_extend``, ``other``; ms per step, from the server's step timer, differenced around each
prompt) and the plain server's decode step (ms per token, from the client: the time of ``1 + K``
new tokens minus that of 1, over ``K``).

With ``--py-spy BIN`` each server is also sampled while it serves the long prompt, and the samples
inside GRAFT's verify (``GraftWorkerV2.verify``) and inside the plain server's decode forward are
broken down by function (inclusive share of samples), which says what a verify adds to a forward.

    python benchmark/studies/profile_verify.py --py-spy py-spy --json out/profile.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmark/
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "models"))

import requests  # noqa: E402
from local_server import SGLangServer  # noqa: E402

DEFAULT_HEAD = HERE / "models" / "smollm2-135m-eagle3"
PHASES = ("draft", "retrieval", "tree", "verify", "draft_extend", "other")


def graft_args(head: Path, n: int) -> list[str]:
    """A GRAFT server verifying ``n >= 2`` draft nodes (root included) at every step (N = 1 is a budget
    only the cost-aware step chooses)."""
    return ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(head),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", str(n),
            "--speculative-graft-budget-mode", "fixed", "--speculative-graft-source", "none",
            "--speculative-graft-thresholds", "0", "0", "0"]


def prompts(tokenizer, long_tokens: int) -> dict[str, list[int]]:
    """A short chat prompt and a long one (about ``long_tokens`` tokens of passages)."""
    import prompt_sets

    short = prompt_sets.load("mt_bench", "bench", 1)[0]
    passages = [p for p in prompt_sets.load("rag", "bench") if p]
    text = ""
    for p in passages:
        text += p + "\n\n"
        if len(tokenizer(text)["input_ids"]) >= long_tokens:
            break
    text += "Summarize the passages above in one paragraph."

    def encode(t: str) -> list[int]:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(chat, add_special_tokens=False)["input_ids"]

    return {"short": encode(short), "long": encode(text)}


def timed(srv: SGLangServer, ids: list[int], new: int) -> float:
    t0 = time.perf_counter()
    srv.generate_ids(ids, new, ignore_eos=True)
    return time.perf_counter() - t0


def step_time(srv: SGLangServer) -> dict:
    info = requests.get(srv.url + "/server_info", timeout=60).json()["internal_states"][0]
    return info["graft"]["economy"]["step_time"]


def scheduler_pids(launcher_pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(launcher_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


class Sampler:
    """``py-spy record`` of a server's processes while a block runs (raw collapsed stacks)."""

    def __init__(self, binary: str | None, srv: SGLangServer, out: Path, seconds: int) -> None:
        self.binary, self.srv, self.out, self.seconds = binary, srv, out, seconds
        self.proc = None

    def __enter__(self):
        if self.binary:
            cmd = [self.binary, "record", "--pid", str(self.srv.proc.pid), "--subprocesses", "--format", "raw",
                   "--rate", "250", "--duration", str(self.seconds), "--nonblocking", "-o", str(self.out)]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.wait(timeout=self.seconds + 60)
        return False


_FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:]+):\d+\)$")


def breakdown(raw: Path, inside: str, top: int = 25) -> dict:
    """Inclusive share of the samples whose stack passes through a frame matching ``inside``
    (``func (file``), per function below it (``module.py:func``)."""
    under, total = Counter(), 0
    pattern = re.compile(inside)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        hit = next((i for i, f in enumerate(frames) if pattern.search(f)), None)
        if hit is None:
            continue
        n = int(count)
        total += n
        seen = set()
        for f in frames[hit + 1:]:
            m = _FRAME.match(f.strip())
            key = f"{Path(m['file']).name}:{m['func']}" if m else f.strip()
            if key not in seen:
                seen.add(key)
                under[key] += n
    return {"samples": total, "share": {k: round(v / total, 3) for k, v in under.most_common(top)} if total else {}}


def profile_plain(model: Path, ids: dict, new: int, logs: Path, spy: str | None) -> dict:
    out = {}
    with SGLangServer(model, [], log_path=logs / "plain.log") as srv:
        srv.generate_ids(ids["short"][:8], 4)
        for ctx, prompt in ids.items():
            one = statistics.median(timed(srv, prompt, 1) for _ in range(3))
            many = statistics.median(timed(srv, prompt, 1 + new) for _ in range(2))
            out[ctx] = {"decode_ms": round(1e3 * (many - one) / new, 2), "prompt_tokens": len(prompt)}
        if spy:
            raw = logs / "plain.pyspy.txt"
            with Sampler(spy, srv, raw, 20):
                timed(srv, ids["long"], 4 * new)
            out["pyspy"] = breakdown(raw, r"TpModelWorker\.forward_batch_generation \(")
    return out


def profile_graft(model: Path, head: Path, n: int, ids: dict, new: int, logs: Path, spy: str | None) -> dict:
    out = {}
    with SGLangServer(model, graft_args(head, n), log_path=logs / f"graft-N{n}.log") as srv:
        srv.generate_ids(ids["short"][:8], 4)
        for ctx, prompt in ids.items():
            before = step_time(srv)
            timed(srv, prompt, 1 + new)
            after = step_time(srv)
            steps = after["steps"] - before["steps"]
            phases = {p: round(1e3 * (after["phase_s"][p] - before["phase_s"][p]) / max(steps, 1), 2) for p in PHASES}
            out[ctx] = {"steps": steps, "phase_ms": phases, "step_ms": round(sum(phases.values()), 2)}
        if spy:
            raw = logs / f"graft-N{n}.pyspy.txt"
            with Sampler(spy, srv, raw, 20):
                timed(srv, ids["long"], 4 * new)
            out["pyspy"] = breakdown(raw, r"GraftWorkerV2\.verify \(")
    return out


def render(report: dict) -> str:
    plain = report["plain"]
    lines = ["| N | context | step ms | draft | tree | verify | draft_extend | other | verify / decode |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, cells in report["graft"].items():
        for ctx in ("short", "long"):
            c, d = cells[ctx], plain[ctx]["decode_ms"]
            p = c["phase_ms"]
            lines.append(f"| {n} | {ctx} ({plain[ctx]['prompt_tokens']} tok) | {c['step_ms']} | {p['draft']} | "
                         f"{p['tree']} | {p['verify']} | {p['draft_extend']} | {p['other']} | "
                         f"{p['verify'] / d:.2f} |")
    lines.append("")
    lines.append("Plain decode step: " + ", ".join(f"{ctx} {plain[ctx]['decode_ms']} ms" for ctx in ("short", "long")))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="target HF dir (default: SmolLM2-135M-Instruct, built offline)")
    ap.add_argument("--draft", type=Path, default=DEFAULT_HEAD)
    ap.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--py-spy", dest="spy", help="py-spy binary: break the verify down by function")
    ap.add_argument("--json", type=Path, default=HERE / "out" / "profile_verify.json")
    args = ap.parse_args()
    if args.model is None:
        import build_smollm2

        args.model = build_smollm2.build(build_smollm2.default_dir("float32"), "float32")
    from transformers import AutoTokenizer

    ids = prompts(AutoTokenizer.from_pretrained(args.model), args.long_tokens)
    logs = args.json.parent / "profile_logs"
    logs.mkdir(parents=True, exist_ok=True)
    report = {"config": {k: str(v) for k, v in vars(args).items()},
              "plain": profile_plain(args.model, ids, args.new_tokens, logs, args.spy), "graft": {}}
    for n in args.budgets:
        report["graft"][str(n)] = profile_graft(args.model, args.draft, n, ids, args.new_tokens, logs, args.spy)
        args.json.write_text(json.dumps(report, indent=1))
    md = render(report)
    args.json.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

"""Record the engine traces ``test_step_trace.py`` replays: one tiny-Llama GRAFT server per mode,
each serving a concurrent batch and then single requests, every engine call recorded
(``step_trace.py``). Run from the repository root after building the tiny fixtures:

    python test/tiny_models.py /tmp/tiny
    python test/record_step_trace.py /tmp/tiny test/data/step_traces

A trace is a behaviour reference: record it before a change to the engine, keep it, and the
replay test proves the change kept every decision. Re-record only for an intended change of
behaviour, and say so in the commit.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_utils import SGLangServer  # noqa: E402
from step_trace import SITECUSTOMIZE, TRACE_ENV, load  # noqa: E402
from test_graft_server import OTHER, REPETITIVE  # noqa: E402

NEW_TOKENS = 24
BATCH = [REPETITIVE[0], REPETITIVE[1], OTHER[0]]
SINGLE = [REPETITIVE[2], OTHER[2]]
TREE = ["--speculative-num-steps", "4", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"]
MODES = {
    "tree-cost": [*TREE, "--speculative-graft-sync-free", "off", "--speculative-graft-plain-steps", "on"],
    "tree-sync-free": [*TREE, "--speculative-graft-sync-free", "on"],
    "tree-fixed": [*TREE, "--speculative-graft-budget-mode", "fixed", "--speculative-graft-sync-free", "off"],
    "chain-cost": ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens",
                   "6", "--speculative-graft-sync-free", "off", "--speculative-graft-plain-steps", "on"],
}


def record(tiny: Path, out: Path, mode: str) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny / "llama")
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in BATCH + SINGLE]
    trace = out / f"{mode}.pt.gz"
    with tempfile.TemporaryDirectory() as shim:
        Path(shim, "sitecustomize.py").write_text(
            SITECUSTOMIZE.format(env=TRACE_ENV, test_dir=str(Path(__file__).resolve().parent)))
        env = {TRACE_ENV: str(trace),
               "PYTHONPATH": os.pathsep.join(p for p in (shim, os.environ.get("PYTHONPATH", "")) if p)}
        args = ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny / "llama-eagle3"),
                *MODES[mode]]
        with SGLangServer(tiny / "llama", args, log_path=out / f"{mode}.log", env=env) as srv:
            with cf.ThreadPoolExecutor(len(BATCH)) as pool:
                list(pool.map(lambda p: srv.generate_ids(p, NEW_TOKENS), ids[: len(BATCH)]))
            for p in ids[len(BATCH):]:
                srv.generate_ids(p, NEW_TOKENS)
    (out / f"{mode}.log").unlink()
    events = load(trace)
    print(f"{mode}: {len(events)} engine calls, {trace.stat().st_size // 1024} KiB")
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tiny", type=Path, help="the tiny fixtures (test/tiny_models.py OUT_DIR)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--modes", default=",".join(MODES))
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for mode in a.modes.split(","):
        record(a.tiny, a.out, mode)


if __name__ == "__main__":
    main()

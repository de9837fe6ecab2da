"""How long a server takes to start, and where GRAFT's part of it goes, one server at a time.

Each configuration is launched ``--repeats`` times (one server up at a time, on an otherwise idle
machine) and timed from the launch until ``/health`` answers 200 (the benchmarks' servers skip
SGLang's warm-up request), the start a user waits for. GRAFT servers also report
``graft.start_up`` from ``/server_info``: the seconds of SGLang's own graph start-up
(``init_cuda_graphs``: the largest budget's state), of building the other budgets' states, and of
warming up GRAFT's Triton tree kernels (shapes run; none on a CPU, where the torch references run).
Then two requests of the same shape (41 prompt tokens, 8 new ones): the first pays what is compiled or
allocated on first use.

Configurations (``--configs``; tiny random models, built by ``test/tiny_models.py``, or SmolLM2):

* ``cpu-*``: the tiny Llama on the CPU port's default attention backend;
* ``interp-*``: the same through SGLang's Triton attention backend under the Triton interpreter
  (``TRITON_INTERPRET=1 --attention-backend triton``): the kernels a GPU runs, interpreted;
* ``smollm2-*``: SmolLM2-135M-Instruct fp32 and the committed head, the CPU default backend.

Each with ``none``, ``eagle3`` (SGLang's EAGLE-3, 6 steps, topk 4, N 16) and ``graft`` (GRAFT's
defaults) or ``graft-cuda`` (the defaults as CUDA resolves them: ``--speculative-graft-sync-free on``).

    python benchmark/studies/start_time.py --tiny DIR [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmark/
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "models"))

EAGLE = ["--speculative-num-steps", "6", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"]
INTERP = (["--attention-backend", "triton", "--triton-attention-num-kv-splits", "1"], {"TRITON_INTERPRET": "1"})
METHODS = {
    "none": [],
    "eagle3": ["--speculative-algorithm", "EAGLE3", *EAGLE],
    "graft": ["--speculative-algorithm", "GRAFT"],
    "graft-cuda": ["--speculative-algorithm", "GRAFT", "--speculative-graft-sync-free", "on"],
}
NEW_TOKENS = 8
DEFAULT_CONFIGS = ("cpu-none,cpu-eagle3,cpu-graft,cpu-graft-cuda,interp-none,interp-eagle3,interp-graft-cuda,"
                   "smollm2-none,smollm2-eagle3,smollm2-graft,smollm2-graft-cuda")


def server_spec(config: str, tiny: Path) -> tuple[Path, list[str], dict]:
    """``(model, server args, env)`` of a configuration ``<models>-<method>``."""
    import build_smollm2

    models, _, method = config.partition("-")
    if models not in ("cpu", "interp", "smollm2") or method not in METHODS:
        raise SystemExit(f"unknown configuration {config!r} (models cpu / interp / smollm2, methods "
                         f"{', '.join(METHODS)})")
    args, env = list(METHODS[method]), {}
    if models == "smollm2":
        model = build_smollm2.build_target("smollm2", "float32")
        head = build_smollm2.head_dir("smollm2")
    else:
        model, head = tiny / "llama", tiny / "llama-eagle3"
        if models == "interp":
            args, env = INTERP[0] + args, dict(INTERP[1])
    if method != "none":
        args += ["--speculative-draft-model-path", str(head)]
    return model, args, env


def start_once(model: Path, args: list[str], env: dict, log: Path) -> dict:
    import requests

    from local_server import SGLangServer

    srv = SGLangServer(model, args, log_path=log, env=env, timeout=600)
    begin = time.monotonic()
    with srv:
        ready = time.monotonic() - begin
        requests_s = []
        for first in (11, 12):  # the same shape twice: the first pays whatever is compiled on first use
            begin = time.monotonic()
            srv.generate_ids([first] + list(range(20, 60)), NEW_TOKENS)
            requests_s.append(round(time.monotonic() - begin, 2))
        info = requests.get(srv.url + "/server_info", timeout=30).json()
    graft = (info.get("internal_states") or [{}])[0].get("graft") or {}
    return {"ready_s": round(ready, 1), "first_request_s": requests_s[0], "second_request_s": requests_s[1],
            "start_up": graft.get("start_up"), "build_s": (graft.get("budget_states") or {}).get("build_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", type=Path, required=True, help="directory of test/tiny_models.py's models")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=HERE / "out" / "start_time.json")
    args = ap.parse_args()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    runs: dict[str, list] = {c: [] for c in configs}
    for _ in range(args.repeats):  # configurations take turns, so a drifting machine moves each alike
        for config in configs:
            model, server_args, env = server_spec(config, args.tiny)
            runs[config].append(start_once(model, server_args, env, args.json.with_name(f"start_{config}.log")))
            print(f"[start_time] {config}: {runs[config][-1]}", flush=True)
    rows = {c: {"ready_s_median": statistics.median(r["ready_s"] for r in rs), "ready_s": [r["ready_s"] for r in rs],
                "first_request_s": [r["first_request_s"] for r in rs],
                "second_request_s": [r["second_request_s"] for r in rs],
                "start_up": rs[-1]["start_up"], "build_s": rs[-1]["build_s"]} for c, rs in runs.items()}
    args.json.write_text(json.dumps(rows, indent=2))
    print("| configuration | ready (s), median | runs | first / second request (s) | GRAFT start-up (last run) |\n"
          "|---|---|---|---|---|")
    for c, r in rows.items():
        print(f"| {c} | {r['ready_s_median']:.1f} | {r['ready_s']} | {r['first_request_s']} / {r['second_request_s']} "
              f"| {r['start_up'] or '-'} |")


if __name__ == "__main__":
    main()

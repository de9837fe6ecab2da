"""Sums a ``BATCH_LOG`` (``benchmark/studies/serving_log/``) per server and run: wall time, seconds
in decode batches and in extends (prefills), the rest (scheduling, waiting for requests), decode
steps, their mean batch size and seconds per step by batch size.

    python benchmark/studies/serving_log_report.py out/batches.jsonl[.gz] [--gap 5]

A run is a stretch of a server's batches without a pause of ``--gap`` seconds (serving_bench's
methods take turns, so each level of each method is one run).
"""
from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def runs(rows: list[dict], gap: float) -> dict[str, list[list[dict]]]:
    """Per server, its batches split where ``gap`` seconds passed without one."""
    out: dict[str, list[list[dict]]] = defaultdict(list)
    for server in sorted({r["server"] for r in rows}):
        mine = sorted((r for r in rows if r["server"] == server), key=lambda r: r["t"])
        for r in mine:
            runs_ = out[server]
            if not runs_ or r["t"] - (runs_[-1][-1]["t"] + runs_[-1][-1]["s"]) > gap:
                runs_.append([])
            runs_[-1].append(r)
    return out


def summary(run: list[dict]) -> dict:
    wall = run[-1]["t"] + run[-1]["s"] - run[0]["t"]
    decode = [r for r in run if r["mode"] == "decode"]
    extend = [r for r in run if r["mode"] == "extend"]
    by_bs: dict[int, list[float]] = defaultdict(list)
    for r in decode:
        by_bs[r["bs"]].append(r["s"])
    return {"wall_s": round(wall, 1), "decode_s": round(sum(r["s"] for r in decode), 1),
            "extend_s": round(sum(r["s"] for r in extend), 1),
            "other_s": round(wall - sum(r["s"] for r in run), 1), "decode_steps": len(decode),
            "mean_decode_bs": round(sum(r["bs"] for r in decode) / max(len(decode), 1), 2),
            "extends": len(extend), "extended_tokens": sum(r["tokens"] for r in extend),
            "decode_ms_by_bs": {bs: (len(s), round(1000 * sum(s) / len(s), 1)) for bs, s in sorted(by_bs.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--gap", type=float, default=5.0)
    args = ap.parse_args()
    text = gzip.decompress(args.log.read_bytes()).decode() if args.log.suffix == ".gz" else args.log.read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for server, server_runs in runs(rows, args.gap).items():
        for i, run in enumerate(server_runs):
            s = summary(run)
            if s["decode_steps"]:
                print(f"{server} run {i}: {json.dumps(s)}")


if __name__ == "__main__":
    main()

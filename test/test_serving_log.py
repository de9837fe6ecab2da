"""``benchmark/studies/serving_log_report.py`` sums a server's batch log per run."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark" / "studies"))

import serving_log_report  # noqa: E402


def _batch(server, mode, bs, t, s, tokens=0):
    return {"server": server, "mode": mode, "bs": bs, "tokens": tokens, "t": t, "s": s}


def test_a_servers_batches_split_into_runs_at_pauses_and_sum_by_mode():
    rows = [_batch("none", "extend", 2, 0.0, 1.0, tokens=300), _batch("none", "decode", 2, 1.5, 0.1),
            _batch("none", "decode", 2, 1.6, 0.1), _batch("none", "decode", 1, 1.7, 0.05),
            _batch("GRAFT", "decode", 4, 1.0, 0.2),
            _batch("none", "extend", 1, 20.0, 0.5, tokens=100), _batch("none", "decode", 1, 20.5, 0.04)]
    runs = serving_log_report.runs(rows, gap=5.0)
    assert [len(r) for r in runs["none"]] == [4, 2] and [len(r) for r in runs["GRAFT"]] == [1]
    first = serving_log_report.summary(runs["none"][0])
    assert first == {"wall_s": 1.8, "decode_s": 0.2, "extend_s": 1.0, "other_s": 0.5, "decode_steps": 3,
                     "mean_decode_bs": 1.67, "extends": 1, "extended_tokens": 300,
                     "decode_ms_by_bs": {1: (1, 50.0), 2: (2, 100.0)}}

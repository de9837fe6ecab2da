"""``benchmark/repeats.py``: repeated runs of one benchmark combined into mean (min-max) per method."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark"))
import repeats  # noqa: E402


def _spec_run(graft: tuple[float, float], identical: bool = True) -> dict:
    """One spec_bench run: none and GRAFT on two categories; GRAFT's speedups as given."""
    rows = []
    for cat, s in zip(("code", "qa"), graft):
        rows.append({"method": "none", "category": cat, "speedup": 1.0, "decode_speedup": 1.0, "tau": 1.0,
                     "identical": True})
        rows.append({"method": "GRAFT", "category": cat, "speedup": s, "decode_speedup": s + 0.5, "tau": 2 * s,
                     "identical": identical})
    return {"results": rows}


def test_spec_bench_runs_give_each_runs_category_mean_as_mean_and_min_max():
    runs = [_spec_run((1.8, 2.0)), _spec_run((2.0, 2.2)), _spec_run((2.2, 1.8), identical=False)]
    c = repeats.combine(runs)
    speed = c["headline"]["GRAFT"]["speedup"]
    # run means 1.9, 2.1, 2.0
    assert speed["mean"] == pytest.approx(2.0) and speed["min"] == pytest.approx(1.9)
    assert speed["max"] == pytest.approx(2.1) and speed["runs"] == 3
    assert c["headline"]["GRAFT"]["decode_speedup"]["mean"] == pytest.approx(2.5)
    assert c["by_category"]["GRAFT"]["code"] == {"mean": pytest.approx(2.0), "min": 1.8, "max": 2.2, "runs": 3}
    assert c["identical"] == {"none": True, "GRAFT": False}
    md = repeats.render(c)
    assert "| GRAFT | 2.00x (1.90-2.10) | 2.50x (2.40-2.60) | 4.00 (3.80-4.20) | False |" in md


def test_serving_bench_runs_combine_per_method_and_concurrency(tmp_path):
    def run(v8, v16):
        rows = []
        for c, v in ((8, v8), (16, v16)):
            rows.append({"method": "none", "concurrency": c, "vs_none": 1.0, "mean_tpot_ms": 100.0,
                         "accept_length": None})
            rows.append({"method": "GRAFT", "concurrency": c, "vs_none": v, "mean_tpot_ms": 100.0 / v,
                         "accept_length": 2.0})
        return {"results": rows}

    paths = []
    for i, (a, b) in enumerate(((1.1, 0.9), (1.2, 1.0), (1.0, 1.1))):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(run(a, b)))
    out = tmp_path / "combined.json"
    repeats.main([*map(str, paths), "--json", str(out)])
    c = json.loads(out.read_text())
    assert c["inputs"] == ["r0.json", "r1.json", "r2.json"]
    assert c["cells"]["GRAFT"]["8"]["vs_none"]["mean"] == pytest.approx(1.1)
    assert c["cells"]["GRAFT"]["16"]["vs_none"]["min"] == pytest.approx(0.9)
    assert c["cells"]["none"]["8"]["accept_length"] is None
    assert "1.10x (1.00-1.20)" in out.with_suffix(".md").read_text()


def test_runs_of_different_commands_are_refused():
    with pytest.raises(ValueError, match="not repeats of one command"):
        repeats.combine([_spec_run((1.0, 1.0)), {"results": [{"method": "none", "category": "qa", "speedup": 1.0,
                                                                "decode_speedup": 1.0, "tau": 1.0, "identical": True}]}])
    with pytest.raises(ValueError, match="different benchmarks"):
        repeats.combine([_spec_run((1.0, 1.0)), {"results": [{"method": "none", "concurrency": 8}]}])

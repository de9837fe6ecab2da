"""Repeated runs of one benchmark command, combined: the mean of the runs and their min-max.

Each input is the ``--json`` of one complete run of ``spec_bench.py`` or ``serving_bench.py`` (the same
command run again; methods take turns inside each run with ``--interleave``). A run's own ratio is
against no speculation *in that run*, so every repeat compares methods on the same stretch of a
machine; the repeats then say how much that ratio moves from run to run.

* ``spec_bench`` runs: per method, the run's headline (its mean over categories of ``speedup``,
  ``decode_speedup`` and ``tau``) as mean (min-max) over runs, and per method x category the mean
  speedup (min-max); ``identical`` is true only if every run's outputs were.
* ``serving_bench`` runs: per method x concurrency, ``vs_none`` (output throughput over no
  speculation's), mean time per output token and accept length, mean (min-max).

Worked example: GRAFT's category means 1.9x, 2.1x and 2.0x in three runs give ``2.00x (1.90-2.10)``.

    python benchmark/repeats.py --json out/batch1_repeats.json out/batch1_r1.json out/batch1_r2.json out/batch1_r3.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean

from plotting import pyplot

SPEC_KEYS = ("speedup", "decode_speedup", "tau")
SERVING_KEYS = ("vs_none", "mean_tpot_ms", "accept_length")


def spread(values: list[float]) -> dict:
    """``{"mean", "min", "max", "runs"}`` of the values that are not None (None if there are none)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"mean": mean(vals), "min": min(vals), "max": max(vals), "runs": len(vals)}


def kind(report: dict) -> str:
    """``spec_bench`` (rows per category) or ``serving_bench`` (rows per concurrency)."""
    row = report["results"][0]
    if "category" in row:
        return "spec_bench"
    if "concurrency" in row:
        return "serving_bench"
    raise ValueError(f"not a spec_bench or serving_bench report: row keys {sorted(row)}")


def _methods(reports: list[dict]) -> list[str]:
    """Methods in the first run's order; every run must have served the same ones."""
    names = [list(dict.fromkeys(r["method"] for r in rep["results"])) for rep in reports]
    for i, n in enumerate(names[1:], 2):
        if set(n) != set(names[0]):
            raise ValueError(f"run {i} served {sorted(n)}, run 1 served {sorted(names[0])}: not repeats of one command")
    return names[0]


def combine_spec_bench(reports: list[dict]) -> dict:
    """Per method: the run's mean over categories of each key, as a spread over runs; per method x
    category the speedup's spread."""
    methods = _methods(reports)
    headline, by_category, identical = {}, {}, {}
    for m in methods:
        rows = [[r for r in rep["results"] if r["method"] == m] for rep in reports]
        headline[m] = {k: spread([mean(r[k] for r in run) for run in rows]) for k in SPEC_KEYS}
        cats = sorted({r["category"] for run in rows for r in run})
        by_category[m] = {c: spread([r["speedup"] for run in rows for r in run if r["category"] == c])
                          for c in cats}
        identical[m] = all(r["identical"] for run in rows for r in run)
    return {"kind": "spec_bench", "runs": len(reports), "headline": headline, "by_category": by_category,
            "identical": identical}


def combine_serving_bench(reports: list[dict]) -> dict:
    """Per method x concurrency: each key's spread over runs."""
    methods = _methods(reports)
    cells = {}
    for m in methods:
        levels = sorted({r["concurrency"] for rep in reports for r in rep["results"] if r["method"] == m})
        cells[m] = {str(c): {k: spread([r.get(k) for rep in reports for r in rep["results"]
                                        if r["method"] == m and r["concurrency"] == c]) for k in SERVING_KEYS}
                    for c in levels}
    return {"kind": "serving_bench", "runs": len(reports), "cells": cells}


def combine(reports: list[dict]) -> dict:
    kinds = {kind(r) for r in reports}
    if len(kinds) != 1:
        raise ValueError(f"runs of different benchmarks: {sorted(kinds)}")
    return combine_spec_bench(reports) if kinds == {"spec_bench"} else combine_serving_bench(reports)


def fmt(s: dict | None, pattern: str = "{:.2f}", suffix: str = "") -> str:
    """``mean (min-max)``, e.g. ``2.00x (1.90-2.10)``."""
    if s is None:
        return "-"
    m, lo, hi = (pattern.format(s[k]) for k in ("mean", "min", "max"))
    return f"{m}{suffix} ({lo}-{hi})"


def render(combined: dict) -> str:
    runs = combined["runs"]
    if combined["kind"] == "spec_bench":
        lines = [f"Mean of {runs} runs (min-max over runs); each run's figure is its mean over categories.", "",
                 "| method | speedup | decode-only speedup | tau | identical |", "|---|---|---|---|---|"]
        for m, h in combined["headline"].items():
            lines.append(f"| {m} | {fmt(h['speedup'], suffix='x')} | {fmt(h['decode_speedup'], suffix='x')} "
                         f"| {fmt(h['tau'])} | {combined['identical'][m]} |")
        cats = sorted({c for per in combined["by_category"].values() for c in per})
        lines += ["", "Speedup by category, mean of runs (min-max):", "",
                  "| method | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
        for m, per in combined["by_category"].items():
            lines.append(f"| {m} | " + " | ".join(fmt(per.get(c), suffix="x") for c in cats) + " |")
        return "\n".join(lines) + "\n"
    levels = sorted({int(c) for per in combined["cells"].values() for c in per})
    lines = [f"Mean of {runs} runs (min-max over runs).", "",
             "| method | " + " | ".join(f"c={c}: vs none | TPOT ms | accept length" for c in levels) + " |",
             "|---|" + "---|---|---|" * len(levels)]
    for m, per in combined["cells"].items():
        cells = []
        for c in levels:
            cell = per.get(str(c), {})
            cells += [fmt(cell.get("vs_none"), suffix="x"), fmt(cell.get("mean_tpot_ms"), "{:.0f}"),
                      fmt(cell.get("accept_length"))]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(combined: dict, path: Path) -> None:
    """Bars: each method's mean ratio to no speculation, whiskers its min-max over runs (spec_bench:
    one group per category plus the mean; serving_bench: one group per concurrency)."""
    plt = pyplot()
    if plt is None:
        return
    if combined["kind"] == "spec_bench":
        groups = sorted({c for per in combined["by_category"].values() for c in per}) + ["mean"]
        cells = {m: [per.get(c) for c in groups[:-1]] + [combined["headline"][m]["speedup"]]
                 for m, per in combined["by_category"].items()}
        ylabel = "speedup over no speculation (batch 1)"
    else:
        groups = sorted({int(c) for per in combined["cells"].values() for c in per})
        cells = {m: [per.get(str(c), {}).get("vs_none") for c in groups] for m, per in combined["cells"].items()}
        groups = [f"c={c}" for c in groups]
        ylabel = "output throughput over no speculation"
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(groups)), 4))
    width = 0.8 / len(cells)
    for i, (m, vals) in enumerate(cells.items()):
        xs = [g + (i - (len(cells) - 1) / 2) * width for g in range(len(groups))]
        means = [v["mean"] if v else 0.0 for v in vals]
        errs = [[v["mean"] - v["min"] if v else 0.0 for v in vals], [v["max"] - v["mean"] if v else 0.0 for v in vals]]
        ax.bar(xs, means, width, yerr=errs, capsize=2, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups, rotation=20)
    ax.set_ylabel(ylabel)
    ax.set_title(f"mean of {combined['runs']} runs, whiskers min-max")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="--json files of repeated runs of one command")
    ap.add_argument("--json", type=Path, required=True, help="combined JSON; a Markdown table is written beside it")
    args = ap.parse_args(argv)
    combined = combine([json.loads(p.read_text()) for p in args.runs])
    combined["inputs"] = [p.name for p in args.runs]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(combined, indent=2))
    md = render(combined)
    args.json.with_suffix(".md").write_text(md)
    plot(combined, args.json.with_suffix(".png"))
    print(md)


if __name__ == "__main__":
    main()

"""The README's two plots, drawn from recorded benchmark JSON (no server runs).

    python benchmark/readme_plots.py [--out docs/img]

* ``batch1_by_category.png``: speedup over no speculation per category at batch 1, every method of
  one ``spec_bench.py --interleave`` run (bars), with a second run of nearby code as markers (the
  run-to-run spread a reader should expect).
* ``load_vs_concurrency.png``: output tokens/s relative to no speculation against concurrency
  (``serving_bench.py``), one line per run, the range of GRAFT's runs shaded, the y axis through 1.0;
  the c=8 and c=16 runs that put the configuration CUDA resolves to (``GRAFT-cuda``) beside GRAFT as points.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from plotting import pyplot

RESULTS = Path(__file__).resolve().parent / "results"
# (label, file): the newest batch-1 run first, then the run its markers come from
BATCH1 = [("code of 42aacab", "smollm2_report_all_memo.json"), ("code of 55bc201", "smollm2_report_all_block12.json")]
# (label, files): each load run, its levels possibly split over files
LOAD = [("code of f5daef2", ["serving_bench_kv_window_report.json", "serving_bench_kv_window_report_c8.json"]),
        ("code of 049b2d9", ["serving_bench_waves_report.json"])]
# a run of other methods at some levels only, drawn as points: (label, file)
LOAD_POINTS = ("code of 7a3556d, AVX2 EPYC", ["serving_bench_c8_joint.json", "serving_bench_c16_joint.json"])
CATEGORIES = ["mt_bench", "code", "rag", "qa", "summarization", "math", "translation"]


def speedups(path: Path) -> dict[str, dict[str, float]]:
    """``{method: {category: speedup}}`` of one spec_bench JSON (the baseline ``none`` left out)."""
    out: dict[str, dict[str, float]] = {}
    for row in json.loads(path.read_text())["results"]:
        if row["method"] != "none":
            out.setdefault(row["method"], {})[row["category"]] = row["speedup"]
    return out


def load_ratios(paths: list[Path]) -> dict[str, dict[int, float]]:
    """``{method: {concurrency: output tokens/s over none's}}`` of one serving_bench run."""
    out: dict[str, dict[int, float]] = {}
    for path in paths:
        for row in json.loads(path.read_text())["results"]:
            if row["method"] != "none":
                out.setdefault(row["method"], {})[row["concurrency"]] = row["vs_none"]
    return out


def plot_batch1(plt, out: Path) -> None:
    (label, name), (label2, name2) = BATCH1
    runs, second = speedups(RESULTS / name), speedups(RESULTS / name2)
    methods = list(runs)
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for i, method in enumerate(methods):
        xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(CATEGORIES))]
        ax.bar(xs, [runs[method][c] for c in CATEGORIES], width, label=method)
        if method in second:
            ax.plot(xs, [second[method][c] for c in CATEGORIES], "k.", markersize=4)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(CATEGORIES)), CATEGORIES)
    ax.set_ylabel("speedup over no speculation")
    ax.set_title(f"Batch 1, SmolLM2-135M fp32, 2-core CPU, report split: bars {label}, dots {label2}")
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "batch1_by_category.png", dpi=110)


def plot_load(plt, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4))
    styles = ["-", "--"]
    graft_runs = []
    for (label, names), style in zip(LOAD, styles):
        for method, by_c in load_ratios([RESULTS / n for n in names]).items():
            cs = sorted(by_c)
            ax.plot(cs, [by_c[c] for c in cs], style, marker="o", label=f"{method}, {label}",
                    color="C0" if method == "GRAFT" else "C1")
            if method == "GRAFT":
                graft_runs.append(by_c)
    cs = sorted(set.intersection(*(set(r) for r in graft_runs)))
    ax.fill_between(cs, [min(r[c] for r in graft_runs) for c in cs], [max(r[c] for r in graft_runs) for c in cs],
                    color="C0", alpha=0.15, label="GRAFT, range of the two runs")
    label, names = LOAD_POINTS
    for method, by_c in load_ratios([RESULTS / n for n in names]).items():
        cs = sorted(by_c)
        ax.plot(cs, [by_c[c] for c in cs], "s" if method == "GRAFT" else "x", markersize=8,
                color="C0" if method == "GRAFT" else "C3", label=f"{method}, {label}")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_ylim(0.75, 1.25)
    ax.set_xticks([8, 16, 32])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s / no speculation's")
    ax.set_title("Under load, SmolLM2-135M fp32, 2-core CPU, report split")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "load_vs_concurrency.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "img")
    args = ap.parse_args()
    plt = pyplot()
    if plt is None:
        raise SystemExit("matplotlib is not installed: bash scripts/install_bench.sh")
    args.out.mkdir(parents=True, exist_ok=True)
    plot_batch1(plt, args.out)
    plot_load(plt, args.out)
    print(f"wrote {args.out}/batch1_by_category.png and load_vs_concurrency.png")


if __name__ == "__main__":
    main()

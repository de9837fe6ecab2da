"""spec_bench's report: the markdown tables (speed and tau by category, the step economy, the
block mode) and the plot of one run's results (``spec_bench.py`` writes them; ``serving_bench.py``
reuses the economy and block tables)."""

from __future__ import annotations

from pathlib import Path

from plotting import pyplot


def _mean_budget(eco: dict) -> float:
    hist = {int(k): v for k, v in eco["budget_histogram"].items()}
    steps = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / steps if steps else 0.0


def render_block(block: dict) -> str:
    """GRAFT's block mode per method (:func:`block_summary`), or nothing."""
    if not block:
        return ""
    lines = ["", "GRAFT over a block draft: draft slots kept and grafted, and block rows verified (the root "
             "included), per request-step, and host ms per decode step by phase:", "",
             "| method | block | pruned | kept / step | grafted / step | rows verified / step | steps without a draft "
             "| of them plain | draft | graft | verify | feed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, b in block.items():
        ms = b["phase_ms_per_step"]
        rows, undrafted, plain = b.get("verified_rows_per_step"), b.get("undrafted_share"), b.get("plain_share")
        lines.append(f"| {name} | {b['block_size']} | {b['pruned_share']:.0%} | {b['kept_per_step']:.2f} | "
                     f"{b['grafted_per_step']:.2f} | {'' if rows is None else f'{rows:.2f}'} | "
                     f"{'' if undrafted is None else f'{undrafted:.0%}'} | {'' if plain is None else f'{plain:.0%}'} | "
                     f"{ms['draft']:.1f} | "
                     f"{ms['graft']:.1f} | {ms['verify']:.1f} | {ms['feed']:.1f} |")
    return "\n".join(lines) + "\n"


def render_economy(economy: dict) -> str:
    """Where a GRAFT step's time goes, how deep it drafts, which budgets it verifies."""
    if not economy:
        return ""
    from sglang_graft.engine.step_timer import PHASES

    lines = ["", "Step-time breakdown (ms per decode step, whole run; `other` = SGLang's bookkeeping and "
             "feeding retrieval) and draft passes:", "",
             "| method | steps | " + " | ".join(PHASES) + " | total | draft passes / step | steps without a draft pass |",
             "|---|---|" + "---|" * (len(PHASES) + 3)]
    for name, eco in economy.items():
        ms = eco["step_time"]["phase_ms_per_step"]
        lines.append(f"| {name} | {eco['steps']} | " + " | ".join(f"{ms[p]:.1f}" for p in PHASES)
                     + f" | {sum(ms.values()):.1f} | {eco['mean_draft_passes']:.2f} | "
                     f"{eco['skipped_drafts'] / max(1, eco['steps']):.0%} |")
    budgets = sorted({int(k) for eco in economy.values() for k in eco["budget_histogram"]})
    lines += ["", "Verify budgets chosen (share of decode steps), and the tokens per step the chosen budget "
              "expected against those committed (cost-aware steps):", "",
              "| method | " + " | ".join(f"N={b}" for b in budgets) + " | mean N | expected | committed |",
              "|---|" + "---|" * (len(budgets) + 3)]
    for name, eco in economy.items():
        lines.append(f"| {name} | {_budget_cells(eco, budgets)} |")
    return "\n".join(lines) + "\n"


def _budget_cells(eco: dict, budgets: list[int]) -> str:
    """Share of steps per verify budget, mean budget, expected and committed tokens per step."""
    hist = {int(k): v for k, v in eco["budget_histogram"].items()}
    steps = max(1, sum(hist.values()))
    check = eco.get("expected_vs_committed") or {}
    tokens = (f"{check['expected_per_step']:.2f} | {check['committed_per_step']:.2f}" if check.get("steps")
              else "- | -")
    return " | ".join(f"{hist.get(b, 0) / steps:.0%}" for b in budgets) + f" | {_mean_budget(eco):.1f} | {tokens}"


def render_category_economy(by_category: dict) -> str:
    """GRAFT's economy per category (``economy_by_category`` in the JSON)."""
    rows = [(name, cat, eco) for name, cats in by_category.items() for cat, eco in sorted(cats.items())]
    if not rows:
        return ""
    budgets = sorted({int(k) for _, _, eco in rows for k in eco["budget_histogram"]})
    lines = ["", "Per category (the decode steps of its prompts): draft loop passes per step, verify budgets chosen "
             "(share of steps), and the tokens per step the chosen budget expected against those committed:", "",
             "| method | category | steps | draft loop passes / step | " + " | ".join(f"N={b}" for b in budgets)
             + " | mean N | expected | committed |",
             "|---|---|---|---|" + "---|" * (len(budgets) + 3)]
    for name, cat, eco in rows:
        lines.append(f"| {name} | {cat} | {eco['steps']} | {eco['mean_draft_passes']:.2f} | "
                     f"{_budget_cells(eco, budgets)} |")
    return "\n".join(lines) + "\n"


def render_markdown(results: list[dict]) -> str:
    cats = sorted({r["category"] for r in results})
    names = list(dict.fromkeys(r["method"] for r in results))
    by = {(r["method"], r["category"]): r for r in results}
    lines = ["| method | " + " | ".join(cats) + " | mean |", "|---|" + "---|" * (len(cats) + 1)]
    for key, fmt in (("tau", "{:.2f}"), ("speedup", "{:.2f}x"), ("decode_speedup", "{:.2f}x")):
        lines.append(f"| **{key}** |" + " |" * (len(cats) + 1))
        for n in names:
            vals = [by[(n, c)][key] for c in cats if (n, c) in by]
            lines.append(f"| {n} | " + " | ".join(fmt.format(by[(n, c)][key]) if (n, c) in by else "-" for c in cats)
                         + f" | {fmt.format(sum(vals) / len(vals))} |")
    lines.append("")
    lines.append("Client time per verify step, every method (ms; prefill included, so an upper bound):")
    lines.append("")
    lines.append("| method | " + " | ".join(cats) + " |")
    lines.append("|---|" + "---|" * len(cats))
    for n in names:
        cells = []
        for c in cats:
            r = by.get((n, c))
            cells.append("-" if r is None else f"{1000 * r['tau'] / r['tok_per_s']:.0f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| method | category | tau | tok/s | speedup | decode tok/s | decode speedup | prefill s "
                 "| retrieval share | identical |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        lines.append(f"| {r['method']} | {r['category']} | {r['tau']:.2f} | {r['tok_per_s']:.1f} | {r['speedup']:.2f}x"
                     f" | {r['decode_tok_per_s']:.1f} | {r['decode_speedup']:.2f}x | {r['prefill_s']:.2f}"
                     f" | {'n/a' if r['retrieval_share'] is None else format(r['retrieval_share'], '.2f')}"
                     f" | {r['identical']} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    cats = sorted({r["category"] for r in results})
    names = list(dict.fromkeys(r["method"] for r in results))
    by = {(r["method"], r["category"]): r for r in results}
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    width = 0.8 / len(names)
    for ax, key in zip(axes, ("tau", "speedup")):
        for i, n in enumerate(names):
            ax.bar([j + i * width for j in range(len(cats))], [by[(n, c)][key] if (n, c) in by else 0 for c in cats],
                   width, label=n)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats, rotation=30)
        ax.set_title(key)
        ax.axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

"""The benchmark harness end to end: every method served for real, outputs token-identical to no
speculation at T = 0 in float32 (the script asserts it), tau >= 1, JSON keys, GRAFT's economy per
category. Once on the tiny fixtures (custom ``--prompts``, T = 1 too, a ``--variant``) and once in
``--quick`` mode on the real pair (SmolLM2-135M-Instruct + the committed EAGLE-3 head, seven built-in
categories; needs ``scripts/install_bench.sh``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pinned_costs import pinned_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.server
METHODS = {"none", "NGRAM", "EAGLE3-tree", "EAGLE3-chain", "EAGLE3-adaptive", "EAGLE3-chain-long", "GRAFT",
           "GRAFT-sam", "GRAFT-recycle", "GRAFT-auto", "GRAFT-prune-only", "GRAFT-fixed"}
KEYS = ("method", "category", "tau", "tok_per_s", "speedup", "decode_tok_per_s", "decode_speedup", "prefill_s",
        "retrieval_share", "identical", "draft_passes", "verify_tokens")


def _run_bench(args: list[str], out: Path, timeout: float, methods: set = METHODS,
               variants: dict | None = None, env: dict | None = None) -> dict:
    """Run spec_bench on ``methods`` plus ``variants`` (name -> 'BASE ARGS'); GRAFT methods are those
    named GRAFT*."""
    variants = variants or {}
    args = [*args, "--methods", ",".join(sorted(methods))]
    for name, spec in variants.items():
        args += ["--variant", f"{name}={spec}"]
    cmd = [sys.executable, str(ROOT / "benchmark" / "spec_bench.py"), *args, "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    served = methods | set(variants)
    assert {r["method"] for r in report["results"]} == served
    for r in report["results"]:
        assert all(key in r for key in KEYS), r
        assert r["tau"] >= 1.0 and r["tok_per_s"] > 0
        # decode-only speed: the server's times from the first token on, reported for every prompt
        assert r["decode_tok_per_s"] > 0 and r["prefill_s"] > 0, r
        if r["method"] == "none":
            assert r["decode_speedup"] == 1.0
    md = out.with_suffix(".md").read_text()
    assert md.startswith("| method |") and "Step-time breakdown" in md and "Verify budgets chosen" in md
    assert "Per category (the decode steps of its prompts)" in md
    graft = {m for m in served if m.startswith("GRAFT")}
    assert set(report["economy"]) == graft == set(report["economy_by_category"])
    for name, eco in report["economy"].items():
        assert eco["steps"] > 0 and sum(eco["budget_histogram"].values()) == eco["steps"], name
        assert set(eco["step_time"]["phase_ms_per_step"]) == {"draft", "retrieval", "tree", "verify",
                                                             "draft_extend", "other"}
        _check_category_economy(report, name)
    assert out.with_suffix(".png").stat().st_size > 0
    return report


def _check_category_economy(report: dict, name: str) -> None:
    """Per category: its steps' budget histogram, expected vs committed tokens; the rows report them."""
    cats = report["economy_by_category"][name]
    rows = {r["category"]: r for r in report["results"] if r["method"] == name}
    assert set(cats) == set(rows), name
    # the categories' steps are the run's, less the warm-up request's
    assert 0 < sum(e["steps"] for e in cats.values()) <= report["economy"][name]["steps"]
    for cat, eco in cats.items():
        hist = {int(k): v for k, v in eco["budget_histogram"].items()}
        assert sum(hist.values()) == eco["steps"] > 0, (name, cat)
        check = eco["expected_vs_committed"]
        assert check["steps"] <= eco["steps"] and check["committed_tokens"] >= check["steps"], (name, cat)
        row = rows[cat]
        assert row["measured_economy"] is True
        assert row["draft_passes"] == pytest.approx(1 + eco["mean_draft_passes"])
        assert row["verify_tokens"] == pytest.approx(sum(k * v for k, v in hist.items()) / eco["steps"])


def test_spec_bench_quick_on_tiny_models(tiny_models, tmp_path):
    args = ["--model", str(tiny_models["llama"]), "--draft", str(tiny_models["llama-eagle3"]),
            "--prompts", str(ROOT / "benchmark/prompts/tiny_test_prompts.jsonl"), "--quick", "--max-new-tokens", "16",
            "--steps", "3", "--topk", "2", "--num-draft-tokens", "8"]
    report = _run_bench(args, tmp_path / "bench.json", 1800)
    assert all(r["identical"] is True for r in report["results"])
    assert {r["category"] for r in report["results"]} == {"repetitive", "other"}
    nominal = {r["method"]: (r["draft_passes"], r["verify_tokens"]) for r in report["results"]}
    assert nominal["EAGLE3-chain"] == (3, 4) and nominal["EAGLE3-chain-long"] == (7, 8)
    assert nominal["EAGLE3-tree"] == (3, 8) and nominal["EAGLE3-adaptive"] == (None, None)
    # T = 1: sampled outputs are not compared, but the methods serve and report (each method's
    # sampling path is checked statistically in test_graft_reliability); a GRAFT variant reports
    # the draft passes and verify tokens it measured, not its base's
    report = _run_bench([*args, "--temperature", "1"], tmp_path / "bench_t1.json", 1800,
                        methods={"none", "GRAFT"}, variants={"GRAFT-shallow": "GRAFT-sam --speculative-num-steps 2"})
    assert report["config"]["temperature"] == "1.0"
    for r in report["results"]:
        if r["method"] == "GRAFT-shallow":
            assert r["measured_economy"] is True and r["draft_passes"] <= 2, r  # 1 extend + at most 1 loop pass


QUICK_METHODS = {"none", "EAGLE3-tree", "GRAFT", "GRAFT-fixed"}


def test_spec_bench_quick_mode_smollm2(tmp_path):
    """``--quick`` as documented, on four of its methods (every method is served on the tiny pair
    above) and 32 new tokens instead of 64: the built-in categories on SmolLM2-135M-Instruct in
    float32. Step costs pinned (``pinned_costs.py``): the draft passes, budgets and accept lengths
    asserted do not depend on how loaded the machine is (with learned costs a loaded machine once made
    a GRAFT method commit 1.36 tokens per step)."""
    report = _run_bench(["--quick", "--max-new-tokens", "32"], tmp_path / "quick.json", 2400, methods=QUICK_METHODS,
                        env=pinned_env(tmp_path / "pinned"))
    sys.path.insert(0, str(ROOT / "benchmark"))
    import prompt_sets

    by_cat: dict[str, set] = {}
    for r in report["results"]:
        assert r["identical"] is True and r["prompts"] == 2, r
        by_cat.setdefault(r["category"], set()).add(r["method"])
    assert by_cat == {c: QUICK_METHODS for c in prompt_sets.CATEGORIES}
    assert report["config"]["max_new_tokens"] == "32" and report["config"]["num_prompts"] == "2"
    # the cost-aware step drafts less than the fixed one (which runs every pass: steps - 1 = 3)
    economy = report["economy"]
    assert economy["GRAFT-fixed"]["mean_draft_passes"] == 3.0
    assert economy["GRAFT"]["mean_draft_passes"] < 3.0 and len(economy["GRAFT"]["budget_histogram"]) > 1
    # the trained head is actually accepted: EAGLE-3 tree and GRAFT commit > 1.5 tokens per step on
    # average over the categories (about 1.6-2.1 when measured)
    for method in ("EAGLE3-tree", "GRAFT", "GRAFT-fixed"):
        taus = [r["tau"] for r in report["results"] if r["method"] == method]
        assert sum(taus) / len(taus) > 1.5, (method, taus)


def test_prompt_sets_report_tune_and_train_are_disjoint():
    """A draft trained on ``train`` never sees a benchmark prompt, and defaults chosen on ``tune`` never
    see a reported one; the full run has 5 of each per category."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import prompt_sets

    for category in prompt_sets.CATEGORIES:
        split = {s: prompt_sets.load(category, s) for s in ("report", "tune", "train", "bench")}
        report, tune, train = (set(split[s]) for s in ("report", "tune", "train"))
        assert all(len(split[s]) >= 5 for s in split), category
        assert not report & tune and not report & train and not tune & train, category
        assert report | tune == set(split["bench"]), category
        assert prompt_sets.load(category, "report", 2) == split["report"][:2]
        assert prompt_sets.load(category) == split["report"]


def test_long_context_prompts_are_3_to_6k_tokens_of_both_kinds_in_every_split():
    """``long_context`` (asked for by name): documents and source files alternate in every split, the
    splits are disjoint, and every benchmark prompt is 3-6.2K SmolLM2 tokens with its chat template."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    sys.path.insert(0, str(ROOT / "benchmark" / "models"))
    import build_smollm2
    import prompt_sets
    import spec_bench
    from transformers import AutoTokenizer

    assert "long_context" in prompt_sets.LONG_CATEGORIES and "long_context" not in prompt_sets.CATEGORIES
    split = {s: prompt_sets.load("long_context", s) for s in ("report", "tune", "train")}
    assert [len(split[s]) for s in ("report", "tune", "train")] == [20, 20, 40]
    assert not set(split["report"]) & set(split["tune"]) and not set(split["train"]) & (
        set(split["report"]) | set(split["tune"]))
    tokenizer = AutoTokenizer.from_pretrained(build_smollm2.build_target("smollm2", "float32"))
    for name in ("report", "tune"):
        kinds = ["code" if p.startswith("Here is a Python module") else "document" for p in split[name]]
        assert kinds == ["document", "code"] * 10, name
        lengths = [len(spec_bench._encode(tokenizer, p)) for p in split[name]]
        assert 3000 <= min(lengths) and max(lengths) <= 6200, (name, sorted(lengths))


def test_a_variant_may_name_its_own_draft_head():
    """``--variant 'old=GRAFT --speculative-draft-model-path OLD'`` serves OLD, not ``--draft``."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import spec_bench

    table = spec_bench.methods(6, 4, 16)
    default = spec_bench.server_args(table["GRAFT"], Path("new-head"), "float32")
    assert default == ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", "new-head",
                       "--dtype", "float32", "--enable-metrics"]
    variant = spec_bench.Method("old", (*table["GRAFT"].args, "--speculative-draft-model-path", "old-head"), 6, True)
    args = spec_bench.server_args(variant, Path("new-head"), "float32")
    assert args.count("--speculative-draft-model-path") == 1
    assert args[args.index("--speculative-draft-model-path") + 1] == "old-head"
    assert spec_bench.server_args(table["none"], Path("new-head"), "float32") == ["--dtype", "float32",
                                                                                  "--enable-metrics"]


def test_a_variant_reports_its_own_nominal_shape():
    """Without GRAFT's measured economy a variant reports the draft passes and verify tokens of its own
    flags, not its base's; SGLang's adaptive speculation chooses them at run time (None)."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import spec_bench

    table = spec_bench.methods(4, 4, 16)
    assert (table["EAGLE3-chain"].draft_steps, table["EAGLE3-chain"].verify_tokens) == (3, 4)
    assert (table["EAGLE3-chain-long"].draft_steps, table["EAGLE3-chain-long"].verify_tokens) == (15, 16)
    assert "--speculative-adaptive" in table["EAGLE3-adaptive"].args
    chain = table["EAGLE3-chain"].args
    assert table["EAGLE3-adaptive"].args[:len(chain)] == chain
    v = spec_bench.variant(table, "tree-small=EAGLE3-tree --speculative-num-steps 2 --speculative-num-draft-tokens 6")
    assert (v.draft_steps, v.verify_tokens, v.needs_draft) == (2, 6, True)
    assert v.args[-4:] == ("--speculative-num-steps", "2", "--speculative-num-draft-tokens", "6")
    v = spec_bench.variant(table, "chain-adaptive=EAGLE3-chain --speculative-adaptive")
    assert (v.draft_steps, v.verify_tokens) == (None, None)
    v = spec_bench.variant(table, "ngram-8=NGRAM --speculative-num-draft-tokens 8")
    assert (v.draft_steps, v.verify_tokens) == (0, 8)
    with pytest.raises(SystemExit):
        spec_bench.variant(table, "x=NOPE --foo")


def test_a_serving_bench_variant_serves_its_base_with_its_own_flags():
    """``serving_bench --variant 'NAME=BASE ARGS'`` runs after the ``--methods`` with BASE's flags and
    ARGS; an unknown base or a taken name is refused."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import serving_bench

    args = serving_bench.parse_args(["--methods", "none,GRAFT", "--variant",
                                     "GRAFT-plain=GRAFT --speculative-graft-plain-steps on"])
    assert args.names == ["none", "GRAFT", "GRAFT-plain"]
    flags = serving_bench.server_args("GRAFT-plain", args)
    assert flags[:4] == ["--speculative-algorithm", "GRAFT", "--speculative-graft-plain-steps", "on"]
    assert "--speculative-draft-model-path" in flags
    assert "--speculative-graft-plain-steps" not in serving_bench.server_args("GRAFT", args)
    for bad in ("x=NOPE --foo", "GRAFT=GRAFT --foo", "=GRAFT"):
        with pytest.raises(SystemExit):
            serving_bench.parse_args(["--variant", bad])


def test_target_picks_its_committed_head_and_a_base_model_gets_plain_prompts(tmp_path):
    """``--target gemma3`` serves Gemma-3-270M's committed head unless ``--draft`` names another; a
    tokenizer without a chat template gets plain-text prompts in serving_bench."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import serving_bench
    import spec_bench

    models = ROOT / "benchmark" / "models"
    for parse in (spec_bench.parse_args, serving_bench.parse_args):
        assert parse([]).draft == models / "smollm2-135m-eagle3"
        assert parse(["--target", "gemma3"]).draft == models / "gemma-3-270m-eagle3"
        assert parse(["--target", "gemma3", "--draft", "mine"]).draft == Path("mine")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    assert serving_bench.chat_flags(tmp_path) == []
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert serving_bench.chat_flags(tmp_path) == ["--apply-chat-template"]


def test_economy_by_category_is_the_difference_of_snapshots():
    """A category's economy: the server's cumulative counters after its prompts less those before."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import spec_bench
    import spec_report

    def snapshot(steps, passes, hist, checked, expected, committed):
        return {"steps": steps, "draft_passes": passes, "skipped_drafts": 0, "budget_histogram": hist,
                "expected_vs_committed": {"steps": checked, "expected_per_step": expected / checked if checked else 0.0,
                                          "committed_per_step": committed / checked if checked else 0.0}}

    before = snapshot(10, 4, {"1": 6, "4": 4}, 8, 12.0, 11)
    after = snapshot(25, 10, {"1": 6, "4": 10, "8": 9}, 20, 42.0, 37)
    eco = spec_bench._category_economy(spec_bench._counters(after) - spec_bench._counters(before))
    assert eco["steps"] == 15 and eco["draft_passes"] == 6 and eco["mean_draft_passes"] == pytest.approx(0.4)
    assert eco["budget_histogram"] == {"4": 6, "8": 9}
    check = eco["expected_vs_committed"]
    assert check["steps"] == 12 and check["committed_tokens"] == 26
    assert check["expected_tokens"] == pytest.approx(30.0) and check["expected_per_step"] == pytest.approx(2.5)
    assert spec_report._mean_budget(eco) == pytest.approx((4 * 6 + 8 * 9) / 15)


def test_interleaved_methods_take_turns_on_every_prompt(monkeypatch, tmp_path):
    """``--interleave``: every server up before the first prompt, each prompt served by every method,
    the order rotating from prompt to prompt, and each method's cells built from its own replies."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import local_server
    import spec_bench

    log = []

    class FakeServer:
        def __init__(self, model, args, log_path):
            self.name = Path(log_path).stem
            assert "--enable-metrics" in args  # the times behind decode-only speed

        def __enter__(self):
            log.append(("up", self.name))
            return self

        def __exit__(self, *exc):
            log.append(("down", self.name))

        def generate_ids(self, ids, max_new, **sampling):
            if max_new == 4:  # the warm-up
                return {}
            log.append((self.name, ids[0]))
            return {"meta_info": {"completion_tokens": max_new, "spec_verify_ct": 2 if self.name != "none" else 0,
                                  "e2e_latency": 0.5, "first_token_latency": 0.25},
                    "output_ids": [ids[0], len(self.name)]}

    monkeypatch.setattr(local_server, "SGLangServer", FakeServer)
    monkeypatch.setattr(spec_bench, "_economy", lambda srv: None)
    monkeypatch.setattr(spec_bench, "_block_counters", lambda srv: None)
    table = spec_bench.methods(4, 4, 16)
    prompts = [("code", "p", [10]), ("code", "p", [11]), ("math", "p", [12])]
    runs = spec_bench.run_interleaved(["none", "NGRAM", "GRAFT"], table, Path("m"), Path("d"), "float32",
                                      prompts, 6, 0.0, tmp_path)
    assert log[:3] == [("up", "none"), ("up", "NGRAM"), ("up", "GRAFT")]
    served = [entry for entry in log if entry[0] not in ("up", "down")]
    assert served == [("none", 10), ("NGRAM", 10), ("GRAFT", 10), ("NGRAM", 11), ("GRAFT", 11), ("none", 11),
                      ("GRAFT", 12), ("none", 12), ("NGRAM", 12)]
    assert sorted(e[1] for e in log if e[0] == "down") == ["GRAFT", "NGRAM", "none"]
    cells, economy, by_category, block = runs["GRAFT"]
    assert economy is None and by_category == {} and block is None
    assert cells["code"].tokens == 12 and cells["code"].verify_steps == 4 and cells["math"].tokens == 6
    assert cells["code"].outputs == [[10, 5], [11, 5]]
    # two prompts of 6 tokens: 5 decoded after the first of each, in 0.25 s each
    assert cells["code"].prefill_seconds == 0.5 and spec_bench._decode_tok_per_s(cells["code"]) == 10 / 0.5
    assert runs["none"][0]["code"].verify_steps == 12  # no spec_verify_ct: one step per token


def test_serving_bench_reads_the_run_and_its_steady_state(tmp_path):
    """``--steady-state``: SGLang's steady-state entry point writes its metrics to their own file."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import serving_bench

    run = {"output_throughput": 50.0, "mean_ttft_ms": 10.0}
    steady = {"concurrency_ratio": 0.8, "output_throughput": 61.5, "duration": 40.0}
    out, steady_out = tmp_path / "level.jsonl", tmp_path / "level.steady.jsonl"
    out.write_text(json.dumps(run) + "\n")
    steady_out.write_text(json.dumps(steady) + "\n")
    assert serving_bench.read_result(out, steady_out) == {**run, "steady": steady}
    assert serving_bench.read_result(out) == run
    steady_out.write_text("")
    with pytest.raises(RuntimeError, match="no steady-state result"):
        serving_bench.read_result(out, steady_out)
    rows = [{"method": m, "concurrency": 8, "output_throughput": t, "vs_none": t / 40, "steady_output_throughput": s,
             "steady_vs_none": s / 50} for m, t, s in (("none", 40.0, 50.0), ("GRAFT", 44.0, 60.0))]
    md = serving_bench.render(rows)
    assert "44.0 (1.10x)" in md and "Steady state" in md and "60.0 (1.20x)" in md
    assert serving_bench.parse_args(["--steady-state", "0.8"]).steady_state == 0.8


def test_serving_bench_disjoint_levels_deal_every_category_and_never_repeat_a_prompt():
    sys.path.insert(0, str(ROOT / "benchmark"))
    import serving_bench

    rows = [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("b", "b2")]
    assert serving_bench.disjoint_levels(rows, [2, 3]) == [[("a", "a1"), ("b", "b1")],
                                                           [("a", "a2"), ("b", "b2"), ("a", "a3")]]
    levels = serving_bench.disjoint_levels(rows, [1, 1])
    assert levels == [[("a", "a1")], [("b", "b1")]]
    with pytest.raises(SystemExit, match="need 6 prompts, the dataset has 5"):
        serving_bench.disjoint_levels(rows, [3, 3])


def test_block_summary_is_the_runs_difference_per_step():
    sys.path.insert(0, str(ROOT / "benchmark"))
    import spec_bench
    import spec_report

    before = {"block_size": 8, "steps": 10, "pruned_steps": 4, "kept_tokens": 30, "grafted_tokens": 5,
              "batch_steps": 10, "draft_s": 1.0, "graft_s": 0.1, "verify_s": 2.0, "feed_s": 0.05}
    after = {"block_size": 8, "steps": 30, "pruned_steps": 14, "kept_tokens": 70, "grafted_tokens": 25,
             "batch_steps": 20, "draft_s": 1.2, "graft_s": 0.15, "verify_s": 3.0, "feed_s": 0.06}
    b = spec_bench.block_summary(before, after)  # a server without the rows counter: every row verified
    assert b["request_steps"] == 20 and b["pruned_share"] == 0.5
    assert b["kept_per_step"] == 2.0 and b["grafted_per_step"] == 1.0 and b["verified_rows_per_step"] == 8.0
    assert b["phase_ms_per_step"] == pytest.approx({"draft": 20.0, "graft": 5.0, "verify": 100.0, "feed": 1.0})
    assert b["undrafted_share"] == 0.0  # a server without the counter: every step drafted
    row = "| GRAFT-DFlash | 8 | 50% | 2.00 | 1.00 | 8.00 | 0% | 0% | 20.0 | 5.0 | 100.0 | 1.0 |"
    assert row in spec_report.render_block({"GRAFT-DFlash": b})
    cut = spec_bench.block_summary({**before, "verified_rows": 80, "undrafted_batch_steps": 2, "plain_batch_steps": 1},
                                   {**after, "verified_rows": 150, "undrafted_batch_steps": 5, "plain_batch_steps": 3})
    assert cut["verified_rows_per_step"] == 3.5 and cut["undrafted_share"] == 0.3 and cut["plain_share"] == 0.2

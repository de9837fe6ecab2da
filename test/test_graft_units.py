"""GRAFT's SGLang-side pieces without a server: flag validation, the CPU sampling verifier's
adapters (against the tree core's reference), and the config plumbing."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sglang_graft.engine.draft_lag import DraftLag
from sglang_graft import config as gc
from sglang_graft.sglang import algorithm, hooks, sampling, seams
from sglang_graft.tree import target_probs_from_logits, verify_tree_sampling


def _validate(cfg=gc.GraftConfig(), **kw):
    args = dict(num_nodes=16, num_steps=6, topk=4)
    args.update(kw)
    gc.validate(cfg, **args)


def test_defaults_validate_and_follow_the_published_split():
    _validate()
    cfg = gc.GraftConfig(budget_mode="fixed")
    assert cfg.resolved_checkpoints(6) == (0, 1, 5)
    assert cfg.resolved_checkpoints(3) == (0, 1, 2)
    pc = cfg.prune_config(61, 6)  # the paper's 60-slot example (root excluded)
    assert pc.keep_per_stage == (8, 24, 40) and pc.checkpoint_depths == (0, 1, 5)
    assert pc.keep_table(61) == (8, 24, 40, 60)
    assert cfg.prune_config(16, 6).keep_per_stage == (2, 6, 10)
    # cost-aware (the default): no cap unless keep fractions are given, then they cap in both modes
    assert gc.GraftConfig().prune_config(16, 6).keep_table(16) == (15, 15, 15, 15)
    for budget in ("cost", "fixed"):
        given = gc.GraftConfig(budget_mode=budget, keep_fractions=(0.0, 0.2, 1.0))
        assert given.prune_config(16, 6).keep_table(16) == (0, 3, 15, 15)


def test_graph_modes_validate():
    for mode in ("auto", "on", "off", "shadow"):
        _validate(gc.GraftConfig(graph=mode))
    assert [gc.GraftConfig(graph=m).resolved_graph() for m in ("auto", "on", "off", "shadow")] == [
        "off", "on", "off", "shadow"]
    with pytest.raises(ValueError, match="--speculative-graft-graph must be one of"):
        _validate(gc.GraftConfig(graph="yes"))
    with pytest.raises(ValueError, match="--speculative-graft-graph on needs --speculative-graft-placement root"):
        _validate(gc.GraftConfig(graph="on", placement="deepest_draft", source="recycle", budget_mode="fixed"))


def test_chain_drafts_and_budgets_beyond_the_draft_validate():
    _validate(topk=1, num_steps=3, num_nodes=4)
    _validate(topk=1, num_steps=3, num_nodes=16)  # slots beyond the chain are grafted
    _validate(topk=2, num_steps=2, num_nodes=32)
    assert gc.resolve_draft_shape(None, 1, None, (6, 4, 16)) == (6, 1, 7)
    assert gc.resolve_draft_shape(3, 1, 12, (6, 4, 16)) == (3, 1, 12)


@pytest.mark.parametrize("cfg,kw,flag", [
    (gc.GraftConfig(source="x"), {}, "--speculative-graft-source"),
    (gc.GraftConfig(placement="deepest_draft", source="sam"), {}, "--speculative-graft-placement"),
    (gc.GraftConfig(recycle_scope="global"), {}, "--speculative-graft-recycle-scope"),
    (gc.GraftConfig(checkpoint_depths=(0, 9)), {}, "--speculative-graft-checkpoint-depths"),
    (gc.GraftConfig(checkpoint_depths=(0, 1)), {}, "--speculative-graft-checkpoint-depths"),
    (gc.GraftConfig(thresholds=(0.1, 2.0, 0.1)), {}, "--speculative-graft-thresholds"),
    (gc.GraftConfig(), dict(num_nodes=1), "--speculative-num-draft-tokens"),
    (gc.GraftConfig(source="none"), dict(num_nodes=200), "--speculative-num-draft-tokens"),
    (gc.GraftConfig(), dict(topk=0), "--speculative-eagle-topk"),
    (gc.GraftConfig(min_retrieval_slots=15), {}, "--speculative-graft-min-retrieval-slots"),
    (gc.GraftConfig(recycle_widths=(9, 90)), {}, "--speculative-graft-recycle-widths"),
])
def test_bad_config_names_the_flag(cfg, kw, flag):
    with pytest.raises(ValueError) as err:
        _validate(cfg, **kw)
    msg = str(err.value)
    assert flag in msg and "\n" not in msg


@pytest.mark.parametrize("name", [n for n, spec in gc._FLAGS.items() if "choices" in spec])
def test_bad_choice_names_the_flag_the_value_and_the_choices(name):
    """Every flag with choices is checked against the choices its CLI flag was declared with."""
    with pytest.raises(ValueError) as err:
        _validate(dataclasses.replace(gc.GraftConfig(), **{name: "bogus"}))
    msg = str(err.value)
    assert gc.flag_name(name) in msg and "'bogus'" in msg and "\n" not in msg, msg
    assert all(c in msg for c in gc._FLAGS[name]["choices"]), msg


def _server_args(**kw):
    base = dict(speculative_draft_model_path="head", device="cpu", page_size=1, speculative_use_rejection_sampling=False,
                speculative_accept_threshold_single=1.0, speculative_accept_threshold_acc=1.0, pp_size=1,
                speculative_adaptive=False, enable_multi_layer_eagle=False, enable_dp_attention=False,
                disaggregation_mode="null", attention_backend=None, prefill_attention_backend=None,
                decode_attention_backend=None, _raw_input={})
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("kw,flag", [
    (dict(speculative_draft_model_path=None), "--speculative-draft-model-path"),
    (dict(device="xpu"), "--device"),
    (dict(page_size=16, _raw_input={"page_size": 16}), "--page-size"),
    (dict(speculative_use_rejection_sampling=True), "--speculative-use-rejection-sampling"),
    (dict(speculative_accept_threshold_single=0.5), "--speculative-accept-threshold-single"),
    (dict(speculative_accept_threshold_acc=0.3), "--speculative-accept-threshold-acc"),
    (dict(pp_size=2), "--pp-size"),
    (dict(_raw_input={"speculative_adaptive": True}), "--speculative-adaptive"),
    (dict(enable_multi_layer_eagle=True), "--enable-multi-layer-eagle"),
    (dict(enable_dp_attention=True), "--enable-dp-attention"),
    (dict(disaggregation_mode="decode"), "--disaggregation-mode"),
    (dict(attention_backend="torch_native"), "--attention-backend"),
    (dict(device="cuda", attention_backend="fa3", _raw_input={"attention_backend": "fa3"}), "--attention-backend"),
    (dict(device="cuda", attention_backend="triton", decode_attention_backend="fa3"), "--decode-attention-backend"),
])
def test_launch_guards_name_the_flag(kw, flag):
    with pytest.raises(ValueError) as err:
        algorithm.check_server_args(_server_args(**kw))
    msg = str(err.value)
    assert msg.startswith(flag) or f" {flag}" in msg, msg
    assert "\n" not in msg


def test_launch_guards_pick_a_tree_verify_backend_when_sglang_picked_another():
    sa = _server_args(device="cuda", attention_backend="fa3")  # e.g. SGLang's Hopper default
    algorithm.check_server_args(sa)
    assert sa.attention_backend == "triton"
    for backend in ("triton", "flashinfer"):
        sa = _server_args(device="cuda", attention_backend=backend, _raw_input={"attention_backend": backend})
        algorithm.check_server_args(sa)
        assert sa.attention_backend == backend
    algorithm.check_server_args(_server_args(attention_backend="intel_amx"))


def test_a_page_size_sglang_picked_for_its_backend_goes_back_to_one():
    """Blackwell with --speculative-eagle-topk 1: SGLang picks trtllm_mha and page size 64 for it;
    GRAFT replaces the backend first, then the page size, and names no flag the user did not pass."""
    sa = _server_args(device="cuda", attention_backend="trtllm_mha", page_size=64)
    algorithm.check_server_args(sa)
    assert (sa.attention_backend, sa.page_size) == ("triton", 1)
    sa = _server_args(device="cuda", attention_backend="flashinfer", page_size=16,
                      _raw_input={"attention_backend": "flashinfer"})
    algorithm.check_server_args(sa)
    assert (sa.attention_backend, sa.page_size) == ("flashinfer", 1)
    with pytest.raises(ValueError, match=r"^--page-size 64: GRAFT needs --page-size 1"):
        algorithm.check_server_args(_server_args(device="cuda", attention_backend="trtllm_mha", page_size=64,
                                                 _raw_input={"page_size": 64}))
    with pytest.raises(ValueError, match=r"^--attention-backend trtllm_mha: GRAFT verifies trees with"):
        algorithm.check_server_args(_server_args(device="cuda", attention_backend="trtllm_mha", page_size=64,
                                                 _raw_input={"attention_backend": "trtllm_mha"}))


def test_cpu_triton_backend_needs_the_interpreter(monkeypatch):
    """On a CPU SGLang's Triton backend runs only in the Triton interpreter: without
    ``TRITON_INTERPRET=1`` GRAFT refuses it, naming the flag and the variable; with it, GRAFT
    serves it, alone (the verify mask has one layout: Triton's FULL rows or intel_amx's block)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        with pytest.raises(ValueError) as err:
            algorithm.check_server_args(_server_args(**{flag: "triton"}))
        msg = str(err.value)
        assert msg.startswith(f"--{flag.replace('_', '-')} triton ") and "TRITON_INTERPRET=1" in msg, msg
        assert "\n" not in msg
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sa = _server_args(attention_backend="triton")
    algorithm.check_server_args(sa)
    assert sa.attention_backend == "triton"
    algorithm.check_server_args(_server_args(attention_backend="triton", prefill_attention_backend="triton",
                                             decode_attention_backend="triton"))
    algorithm.check_server_args(_server_args(attention_backend="intel_amx"))
    with pytest.raises(ValueError, match="--attention-backend triton --decode-attention-backend intel_amx: "
                                         "on a CPU GRAFT needs one attention backend"):
        algorithm.check_server_args(_server_args(attention_backend="triton", decode_attention_backend="intel_amx"))
    with pytest.raises(ValueError, match="GRAFT verifies trees with intel_amx or triton on cpu"):
        algorithm.check_server_args(_server_args(attention_backend="torch_native"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        algorithm.check_server_args(_server_args(attention_backend="triton"))
    # on CUDA the interpreter changes nothing
    sa = _server_args(device="cuda", attention_backend="triton", _raw_input={"attention_backend": "triton"})
    algorithm.check_server_args(sa)
    assert sa.attention_backend == "triton"


def test_cli_flags_round_trip():
    parser = argparse.ArgumentParser()
    gc.add_cli_args(parser)
    ns = parser.parse_args(["--speculative-graft-source", "recycle", "--speculative-graft-thresholds", "1", "0.5",
                            "0.2", "--speculative-graft-recycle-widths", "4", "4", "--speculative-graft-recycle-scope",
                            "shared", "--speculative-graft-per-step-metrics"])
    cfg = gc.config_from_namespace(ns)
    assert cfg.source == "recycle" and cfg.thresholds == (1.0, 0.5, 0.2) and cfg.recycle_widths == (4, 4)
    assert cfg.recycle_scope == "shared" and cfg.per_step_metrics is True
    assert gc.config_from_namespace(parser.parse_args([])) == gc.GraftConfig()


@pytest.mark.parametrize("ids,ok", [
    ([1, 2, 3], True), ([0, 99], True), (None, True), ([], False), ([100], False), ([5, -1], False),
    ([2 ** 20], False), ([1, "x"], False),
])
def test_input_ids_checked_against_the_vocabulary(ids, ok):
    if ok:
        hooks.check_input_ids(ids, 100)
    else:
        with pytest.raises(ValueError) as err:
            hooks.check_input_ids(ids, 100)
        assert "\n" not in str(err.value)


def test_per_step_counts_aggregate_per_request():
    steps = {"graft_stage": [0, 2, 2], "graft_draft_accepted": [1, 0, 3], "graft_retrieved_accepted": [0, 4, 0],
             "graft_proposed": [3, 15, 7], "graft_verify": ["greedy"] * 3, "graft_plain": [1, 1]}
    assert hooks.aggregate_steps(steps) == {"graft_draft_accepted": 4, "graft_retrieved_accepted": 4,
                                            "graft_proposed": 25, "graft_stage_histogram": [1, 0, 2],
                                            "graft_plain_steps": 2, "graft_verify": "greedy"}
    assert hooks.aggregate_steps({}) == {"graft_draft_accepted": 0, "graft_retrieved_accepted": 0,
                                         "graft_proposed": 0, "graft_stage_histogram": [], "graft_plain_steps": 0}
    # SGLang pads a key this request lacks, and another request of the output batch has, with None
    # (a server once died here: sum() over a None when plain and speculative steps shared a batch)
    padded = {"graft_stage": [None, 2, None], "graft_draft_accepted": [None, 3, None],
              "graft_retrieved_accepted": [None, 0, None], "graft_proposed": [None, 7, None],
              "graft_verify": [None, "greedy", None], "graft_plain": [1, None, 1]}
    assert hooks.aggregate_steps(padded) == {"graft_draft_accepted": 3, "graft_retrieved_accepted": 0,
                                             "graft_proposed": 7, "graft_stage_histogram": [0, 0, 1],
                                             "graft_plain_steps": 2, "graft_verify": "greedy"}


def test_a_failing_accounting_hook_stays_with_its_response(caplog, monkeypatch):
    """The tokenizer manager runs every output through GRAFT's meta-info hooks in one loop; an
    exception there (a malformed per-step value) is reported on that response and logged, and the
    loop goes on (a server once died in this hook)."""
    from types import SimpleNamespace

    from sglang_graft.config import GraftConfig

    manager = SimpleNamespace(server_args=SimpleNamespace(**{seams.GRAFT_CONFIG_ATTR: GraftConfig()}))
    calls = []

    def original(tm, meta_info, state, info, index):
        calls.append(dict(info))
        meta_info.update({k: v[index] for k, v in info.items()})

    hook = hooks.isolated(hooks._update_meta_info)
    good = {"graft_draft_accepted": [[2, 1]], "graft_retrieved_accepted": [[0, 3]], "graft_proposed": [[7, 7]],
            "graft_stage": [[1, 2]], "graft_verify": [["greedy", "greedy"]], "other": ["x"]}
    meta, state = {}, SimpleNamespace(customized_info_accumulated={})
    assert hook(original, manager, meta, state, good, 0) is None
    assert meta["graft_draft_accepted"] == 3 and meta["graft_retrieved_accepted"] == 3 and meta["other"] == "x"
    assert hooks.ERROR_KEY not in meta
    bad = {**good, "graft_draft_accepted": [["two", 1]]}  # sum() over a str raises TypeError
    meta, state = {}, SimpleNamespace(customized_info_accumulated={})
    with caplog.at_level("ERROR"):
        assert hook(original, manager, meta, state, bad, 0) is None
    assert meta["other"] == "x"  # SGLang's own keys still reach the response
    assert meta[hooks.ERROR_KEY].startswith("_update_meta_info: TypeError"), meta
    assert "graft_draft_accepted" not in meta
    assert any(hooks.ERROR_KEY in r.getMessage() for r in caplog.records)
    # the spec-metrics hook: a non-numeric count is reported the same way
    monkeypatch.setattr(hooks, "_serving_graft", lambda: True)
    meta = {"spec_num_proposed_drafts": 10, "graft_proposed": "7", "spec_num_correct_drafts": 3}
    hooks.isolated(hooks._spec_metrics_as_verified)(None, manager, meta)
    assert meta[hooks.ERROR_KEY].startswith("_spec_metrics_as_verified: TypeError"), meta


def test_a_plain_step_runs_no_draft_pass_or_tree():
    """``GraftDraftWorker.draft`` on a step the stepper decides plain (after retrieval, from the
    draft's first level): the roots alone as a one-node verify input (positions ``seq_lens``, no
    links); the draft runner and the tree builder are never called. The stepper is asked with the
    first-level pool in the target vocabulary (the head's ``hot_token_id`` map applied)."""
    from sglang_graft.engine.plans import PlainPlan
    from sglang_graft.sglang.draft_worker import GraftDraftWorker

    def never(*a, **k):
        raise AssertionError("speculative work in a plain step")

    roots_added, asked = [], []
    worker = object.__new__(GraftDraftWorker)
    worker.speculative_num_steps, worker.topk = 3, 2
    worker.hot_token_id = torch.arange(100, 110)
    worker.runner = SimpleNamespace(run=never)
    worker._build_verify_input = never
    worker._prepare_retrieval = lambda rids, roots: roots_added.append((rids, roots.tolist()))
    worker._begin = lambda rids, roots, batch, context: SimpleNamespace(rids=rids, context=context)

    def plain_plan(plan, pool):
        asked.append(pool)
        return PlainPlan(plan.rids, context=plan.context)

    worker.context = SimpleNamespace(stepper=SimpleNamespace(considers_plain=lambda plan: True, plain_plan=plain_plan),
                                     lag=DraftLag(0))
    spec_info = SimpleNamespace(bonus_tokens=torch.tensor([7, 9], dtype=torch.int32),
                                topk_p=torch.tensor([[0.6, 0.3], [0.5, 0.4]]), topk_index=torch.tensor([[1, 2], [3, 4]]))
    batch = SimpleNamespace(reqs=[SimpleNamespace(rid="a", seqlen=6), SimpleNamespace(rid="b", seqlen=12)],
                            forward_mode=SimpleNamespace(is_idle=lambda: False), spec_info=spec_info,
                            seq_lens=torch.tensor([5, 11]))
    vi = GraftDraftWorker.draft(worker, batch)
    assert roots_added == [(["a", "b"], [7, 9])]  # a request's first root still reaches its store
    assert asked[0].tokens.tolist() == [[101, 102], [103, 104]] and asked[0].scores.tolist() == spec_info.topk_p.tolist()
    assert vi.plain.rids == ["a", "b"] and vi.graft_info is None and vi.draft_token_num == 1
    assert vi.plain.context == 18  # the batch's context tokens (Req.seqlen), which the cost model prices
    assert vi.draft_token.tolist() == [7, 9] and vi.positions.tolist() == [5, 11]
    assert vi.retrieve_index.tolist() == [[0], [1]]
    assert vi.retrieve_next_token.tolist() == vi.retrieve_next_sibling.tolist() == [[-1], [-1]]


def test_first_level_pool_is_the_pool_the_draft_loop_reads_before_its_first_pass():
    """``first_level_pool`` equals what ``DraftRecorder`` holds when SGLang's draft loop has
    selected its first level (SGLang's own select on the mapped top-k), tree and chain."""
    from sglang_graft.sglang import seams
    from sglang_graft.sglang.draft_runner import DraftRecorder, first_level_pool

    hot = torch.arange(50, 90)
    gen = torch.Generator().manual_seed(3)
    topk_p = torch.rand(3, 4, generator=gen).sort(dim=1, descending=True).values
    spec_info = SimpleNamespace(topk_p=topk_p, topk_index=torch.randint(0, 40, (3, 4), generator=gen))
    recorder = DraftRecorder(None, None, 4, None)
    recorder.select(seams.SELECT_TOP_K.resolve())(0, topk_p, hot[spec_info.topk_index], torch.zeros(3, 8), None, 4)
    want, got = recorder.pool(), first_level_pool(spec_info, 4, hot)
    for field in ("tokens", "parents", "scores", "depths"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert (got.topk, got.num_steps) == (want.topk, want.num_steps) == (4, 1)
    chain = first_level_pool(SimpleNamespace(topk_p=topk_p[:, :1], topk_index=spec_info.topk_index[:, :1]), 1, hot)
    assert chain.tokens.tolist() == hot[spec_info.topk_index[:, :1]].tolist() and chain.scores.tolist() == topk_p[:, :1].tolist()


def test_spec_metrics_count_the_nodes_verified(monkeypatch):
    """SGLang's largest-N estimate of proposed drafts is replaced by GRAFT's count; without one
    (sync-free responses) the estimate is dropped."""
    monkeypatch.setattr(hooks, "_serving_graft", lambda: True)
    meta = {"spec_num_proposed_drafts": 118 * 15, "spec_accept_rate": 27 / 1770, "spec_num_correct_drafts": 27,
            "graft_proposed": 60}
    hooks._spec_metrics_as_verified(None, None, meta)
    assert meta["spec_num_proposed_drafts"] == 60 and meta["spec_accept_rate"] == pytest.approx(27 / 60)
    meta = {"spec_num_proposed_drafts": 1770, "spec_accept_rate": 0.01, "spec_num_correct_drafts": 27}
    hooks._spec_metrics_as_verified(None, None, meta)
    assert "spec_num_proposed_drafts" not in meta and "spec_accept_rate" not in meta
    monkeypatch.setattr(hooks, "_serving_graft", lambda: False)
    meta = {"spec_num_proposed_drafts": 1770, "spec_accept_rate": 0.01}
    hooks._spec_metrics_as_verified(None, None, meta)
    assert meta["spec_num_proposed_drafts"] == 1770


def test_renorm_adapters_match_the_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    probs = torch.softmax(logits, dim=-1)
    k = torch.tensor([1, 2, 5, 50, 7, 3])
    p = torch.tensor([0.9, 0.5, 1.0, 0.3, 0.99, 0.7])
    ones = torch.ones(6)
    torch.testing.assert_close(sampling.top_k_renorm_prob(probs, k), target_probs_from_logits(logits, ones, top_k=k))
    torch.testing.assert_close(sampling.top_p_renorm_prob(probs, p), target_probs_from_logits(logits, ones, top_p=p))


def test_cpu_sampling_verify_writes_the_reference_result_in_place():
    g = torch.Generator().manual_seed(1)
    bs, n, v = 3, 5, 11
    cand = torch.randint(0, v, (bs, n), generator=g)
    parents = [-1, 0, 0, 1, 1]  # siblings 1,2 and 3,4; make sibling tokens unique
    cand[:, 2] = (cand[:, 1] + 1) % v
    cand[:, 4] = (cand[:, 3] + 1) % v
    from sglang_graft.tree import flatten
    layout = flatten(cand, torch.tensor([parents] * bs), torch.full((bs,), 7))
    probs = torch.softmax(torch.randn(bs, n, v, generator=g), dim=-1)
    coins, final = torch.rand(bs, n, generator=g), torch.rand(bs, generator=g)
    ref = verify_tree_sampling(cand, layout.flat_index, layout.first_child, layout.next_sibling,
                               probs, coins, final, num_speculative_tokens=n)
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    sampling.cpu_sampling_verify(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=cand,
        retrive_index=layout.flat_index, retrive_next_token=layout.first_child,
        retrive_next_sibling=layout.next_sibling, uniform_samples=coins,
        uniform_samples_for_final_sampling=final, target_probs=probs, draft_probs=torch.zeros_like(probs))
    assert torch.equal(predicts.long(), ref[0].long()) and torch.equal(accept_index.long(), ref[1].long())
    assert torch.equal(accept_num.long(), ref[2].long())


def test_positions_past_the_context_are_clamped_in_place(monkeypatch):
    """Under GRAFT a forward's positions never pass ``context_len - 1`` (the rotary table's end for
    most models); positions inside the context are untouched, other algorithms are left alone."""
    from types import SimpleNamespace

    runner = SimpleNamespace(model_config=SimpleNamespace(context_len=2048))
    positions = torch.tensor([2040, 2046, 2047, 2048, 2055])
    batch = SimpleNamespace(positions=positions)
    monkeypatch.setattr(hooks, "_serving_graft", lambda: True)
    assert hooks._positions_inside_the_context(runner, batch) is None
    assert batch.positions is positions and positions.tolist() == [2040, 2046, 2047, 2047, 2047]
    monkeypatch.setattr(hooks, "_serving_graft", lambda: False)
    other = torch.tensor([2050])
    hooks._positions_inside_the_context(runner, SimpleNamespace(positions=other))
    assert other.tolist() == [2050]


def test_the_warm_up_compiles_the_pool_depths_a_step_can_have():
    """Cost-aware steps stop drafting at any depth, so the warm-up compiles every pool size; the fixed
    budget drafts every level (``keep_drafting`` always runs the pass), so one pool size serves it."""
    from sglang_graft.engine.retrieval_state import GraftRetrieval
    from sglang_graft.engine.step import GraftStepper
    from sglang_graft.tree.pipeline import warm_up_depths

    assert warm_up_depths(6, overrides=True) == (1, 2, 3, 4, 5, 6)
    assert warm_up_depths(6, overrides=False) == (6,)
    cfg = gc.GraftConfig(budget_mode="fixed")
    fixed = GraftStepper(cfg, GraftRetrieval(cfg, 50, 8, 3, "cpu"), 3, 2, (8,), "cpu")
    assert not fixed.cost_aware
    plan = SimpleNamespace(passes=0)
    assert all(fixed.keep_drafting(plan, None) for _ in range(3)) and plan.passes == 3


def test_hidden_states_stop_at_the_finish(monkeypatch):
    """A verify step that accepts past ``max_new_tokens`` returns rows for the kept tokens only
    (SGLang's own clip for ``return_hidden_states="last"``); other requests are left alone."""
    from types import SimpleNamespace

    from sglang_graft.sglang import hooks

    monkeypatch.setattr(hooks, "_serving_graft", lambda: True)
    seen = []

    def original(*, req, hidden_states, start, accept_len):
        seen.append(accept_len)

    req = SimpleNamespace(return_hidden_states=True, output_ids=list(range(10)), finished_len=7)
    hooks._hidden_states_to_the_finish(original, req=req, hidden_states=None, start=0, accept_len=4)
    running = SimpleNamespace(return_hidden_states=True, output_ids=list(range(10)), finished_len=None)
    hooks._hidden_states_to_the_finish(original, req=running, hidden_states=None, start=0, accept_len=4)
    last = SimpleNamespace(return_hidden_states="last", output_ids=list(range(10)), finished_len=7)
    hooks._hidden_states_to_the_finish(original, req=last, hidden_states=None, start=0, accept_len=4)
    assert seen == [1, 4, 4]  # 3 of the step's 4 tokens were past the finish


def test_node_penalties_count_a_step_the_scheduler_has_not_processed():
    """Under the overlap scheduler ``output_ids`` lack the previous launch's tokens: a penalised
    request's committed output is ``output_ids`` plus them (from the device); without it, or once
    another launch came in between, ``output_ids`` alone."""
    from types import SimpleNamespace

    import torch

    from sglang_graft.sglang.penalties import NodePenalties

    params = SimpleNamespace(frequency_penalty=0.5, presence_penalty=0.0, repetition_penalty=1.0,
                             min_new_tokens=0, stop_token_ids=None)
    req = SimpleNamespace(rid="a", output_ids=[4, 5], sampling_params=params, eos_token_ids=None)
    info = SimpleNamespace(acc_additive_penalties=torch.zeros(1, 8), acc_scaling_penalties=None)
    batch = SimpleNamespace(reqs=[req], sampling_info=info)
    pen = NodePenalties()

    def committed(lagging):
        return [t for t in pen._committed([req], "cpu", lagging)[0].tolist() if t >= 0]  # -1: padding

    pen.begin_launch()
    pen.record(batch, torch.tensor([[6, 7, 1]]), torch.tensor([2]))  # this launch committed 6, 7
    pen.begin_launch()  # the next launch: 6, 7 are not in output_ids yet under overlap
    assert committed(lagging=True) == [4, 5, 6, 7]
    assert committed(lagging=False) == [4, 5]
    pen.begin_launch()  # another launch in between (e.g. a prefill of other requests)
    assert committed(lagging=True) == [4, 5]

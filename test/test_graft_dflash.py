"""GRAFT with a DFlash block draft, chain-grafted (``sglang_graft.sglang.block_worker``): selected by
the draft's type (``--speculative-algorithm GRAFT`` with the tiny ``DFlashDraftModel``), token-exact
against the tiny Llama served without speculation, alone, batched and on edge requests, with
retrieved tokens accepted on repetitive prompts and the draft's own block on ``DFLASH_RUN_PROMPT``;
sampled requests (temperature 1, and top-k 2) verified by sampling, also on a CPU, their tokens
fitting the target's distribution as no speculation's do; the torch op SGLang's chain-sampling verify
runs with on a CPU, coin for coin against the CUDA kernel's rule; and the prune / graft rule on
tensors (``sglang_graft.sglang.block_graft``).

The tiny draft's confidences are about 7e-4 at every position (its aimed norm gains lift one token a
little above a 4096-token vocabulary), so with the default thresholds every block is pruned to the
root and retrieval fills it. The first server verifies whole blocks one request at a time and, in
batches, each block up to its grafted chain (the CPU default); the second keeps one draft token per
block (one checkpoint at depth 0, threshold 1e-4), grafts after it (the re-rooted retrieval path) and
verifies up to the chain at batch 1 too (``--speculative-graft-ragged on``); the third drafts nothing
(``--speculative-graft-skip-draft-tokens 0``: every block holds its retrieved chain alone). The rate
guard's probes leave the draft out of one step in eight on every server here (timing pinned where
the counts are asserted, so no rate is judged); the draft-or-not rule is tested on its own, its rates
given. A fourth server verifies whole blocks in batches too (``--speculative-graft-ragged off``: the
block mode as a CUDA target resolves it)."""

from __future__ import annotations

import concurrent.futures as cf
import time
from types import SimpleNamespace

import pytest
import requests
import torch

from pinned_costs import pinned_env
from server_utils import SGLangServer
from tiny_models import DFLASH_BLOCK, DFLASH_RUN_PROMPT

from sglang_graft.sglang.block_graft import (
    accepted_provenance, best_chain, chain_expected, chain_feedback, cut_after, depth_thresholds, graft_block,
    kept_lengths, verify_lengths,
)
from sglang_graft.tree import RetrievalProposals

NEW_TOKENS = 40
RANDOM = [1, 100, 200, 300, 5, 42, 7]
REPETITIVE = [[5, 6, 7, 8] * 6, [11, 12, 13, 14, 15] * 5]  # the target answers both with loops
PROMPTS = [DFLASH_RUN_PROMPT, RANDOM, *REPETITIVE]
M = DFLASH_BLOCK - 1


def _args(tiny_models, *extra):
    return ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-dflash"]),
            "--max-running-requests", "8", *extra]


def _graft_info(srv) -> dict:
    return requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]["graft"]


@pytest.fixture(scope="module")
def reference(plain_llama):
    return [plain_llama.generate_ids(p, NEW_TOKENS)["output_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def block_server(tiny_models, server_logs, tmp_path_factory):
    # the rate guard times no step (pinned_env), so its probes alone leave the draft out: one step in 8
    with SGLangServer(tiny_models["llama"], _args(tiny_models), log_path=server_logs / "graft-dflash.log",
                      env=pinned_env(tmp_path_factory.mktemp("pinned"))) as srv:
        yield srv


@pytest.mark.server
def test_token_exact_with_retrieval_and_draft_tokens_accepted(block_server, reference):
    """One request at a time: every row of each block is verified (``--speculative-graft-ragged
    auto`` cuts blocks in batches of two or more)."""
    outs = [block_server.generate_ids(p, NEW_TOKENS) for p in PROMPTS]
    assert [o["output_ids"] for o in outs] == reference
    metas = [o["meta_info"] for o in outs]
    for meta in metas:  # every step verified one block of M draft slots, every block pruned (see above)
        assert meta["graft_proposed"] == meta["spec_verify_ct"] * M == meta["spec_num_proposed_drafts"], meta
        assert meta["graft_stage_histogram"] == [0, meta["spec_verify_ct"]], meta
        assert meta["graft_draft_accepted"] + meta["graft_retrieved_accepted"] == meta["spec_num_correct_drafts"]
        assert meta["graft_verify"] == "greedy"
    run, random_prompt, *repetitive = metas
    assert run["graft_draft_accepted"] > 0 and run["spec_accept_length"] > 2, run  # the draft's own block
    assert random_prompt["spec_num_correct_drafts"] == 0, random_prompt
    for meta in repetitive:  # the target's loops, proposed by retrieval
        assert meta["graft_retrieved_accepted"] > 0, meta
    info = _graft_info(block_server)
    block = info["block"]
    assert info["draft"] == "dflash" and block["block_size"] == DFLASH_BLOCK
    assert block["pruned_steps"] == block["steps"] > 0 and block["grafted_tokens"] > 0
    assert block["verified_rows"] == block["steps"] * DFLASH_BLOCK, block
    # the grafted chains' nodes taught the calibration what they are worth (none here alone expects 3 tokens)
    calibration = info["calibration"]
    assert sum(sum(c["shown"]) for name, c in calibration.items() if name != "draft") > 0, calibration
    # none expects 3 tokens: only the rate guard's probes (one step in 8, its timing pinned) left the draft out
    assert 0 < block["undrafted_batch_steps"] == block["guarded_batch_steps"] <= block["batch_steps"] // 8, block
    assert info["rate_guard"] == {"draft": {}, "plain": {}}, info["rate_guard"]  # pinned: no rate judged
    # the phase clocks: one set per batch step (here one request a step), every phase timed
    assert 0 < block["batch_steps"] <= block["steps"]
    assert all(block[f"{phase}_s"] > 0 for phase in ("draft", "graft", "verify", "feed")), block
    assert info["accepted_retrieved_tokens"] >= sum(m["graft_retrieved_accepted"] for m in metas)
    assert info["live_stores"] == 0  # every finished request freed its store


@pytest.mark.server
def test_batched_requests_are_token_exact_and_verified_up_to_their_chains(block_server, reference):
    """In a batch (the CPU default) each block is verified up to its grafted chain only: SGLang's
    own count of proposed drafts is what GRAFT verified, below a whole block a step."""
    before = _graft_info(block_server)["block"]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: block_server.generate_ids(p, NEW_TOKENS), PROMPTS))
    assert [o["output_ids"] for o in outs] == reference
    assert sum(o["meta_info"]["graft_retrieved_accepted"] for o in outs) > 0
    after = _graft_info(block_server)["block"]
    steps, rows = after["steps"] - before["steps"], after["verified_rows"] - before["verified_rows"]
    metas = [o["meta_info"] for o in outs]
    assert rows == steps + sum(m["graft_proposed"] for m in metas) < steps * DFLASH_BLOCK, (rows, steps)
    for meta in metas:
        assert meta["graft_proposed"] == meta["spec_num_proposed_drafts"] <= meta["spec_verify_ct"] * M, meta
    # the plain guard's probes (one batch step in 8 of a bucket, timing pinned): the roots alone, one row each
    assert after["plain_batch_steps"] > before["plain_batch_steps"], (before, after)
    assert after["batch_steps"] - before["batch_steps"] < steps  # the requests shared steps


@pytest.mark.server
def test_edge_requests(block_server, plain_llama, reference):
    """One new token; a stop string; an aborted request, after which the next one is still exact."""
    one = block_server.generate_ids(RANDOM, 1)
    assert one["output_ids"] == reference[1][:1] and one["meta_info"]["finish_reason"]["type"] == "length"
    sampled = block_server.generate_ids(RANDOM, 16, temperature=0.8, top_p=0.9, sampling_seed=7)
    assert len(sampled["output_ids"]) == 16  # grafted too (DFLASH's sampled verify is target-only)
    assert sampled["meta_info"]["graft_verify"] == "sampling"  # on a CPU too (torch_sampled_verify)
    plain = plain_llama.generate_ids(REPETITIVE[1], NEW_TOKENS)
    text = plain["text"]
    stop = text[len(text) // 2: len(text) // 2 + 4]
    stopped = [srv.generate_ids(REPETITIVE[1], NEW_TOKENS, stop=[stop]) for srv in (plain_llama, block_server)]
    assert stopped[0]["meta_info"]["finish_reason"]["type"] == "stop", stopped[0]["meta_info"]
    assert stopped[1]["output_ids"] == stopped[0]["output_ids"] and stopped[1]["text"] == stopped[0]["text"]
    assert stopped[1]["meta_info"]["finish_reason"] == stopped[0]["meta_info"]["finish_reason"]
    rid = "graft-dflash-abort-me"
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(requests.post, block_server.url + "/generate", json={
            "rid": rid, "input_ids": REPETITIVE[0],
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}, timeout=300)
        deadline = time.time() + 60
        while time.time() < deadline and _graft_info(block_server)["live_stores"] == 0:
            time.sleep(0.05)
        assert _graft_info(block_server)["live_stores"] == 1  # it runs: its store is live
        requests.post(block_server.url + "/abort_request", json={"rid": rid}, timeout=30)
        aborted = fut.result().json()
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    time.sleep(1.0)
    assert _graft_info(block_server)["live_stores"] == 0
    assert block_server.generate_ids(REPETITIVE[0], NEW_TOKENS)["output_ids"] == reference[2]


@pytest.mark.server
def test_kept_prefix_then_graft_verified_up_to_the_chain(tiny_models, server_logs, reference, tmp_path_factory):
    """One checkpoint at depth 0, threshold 1e-4: the first draft token of every block is kept
    (7e-4), the rest grafted after it (retrieval re-rooted along the kept token); with
    ``--speculative-graft-ragged on`` a single request's block is verified up to its chain (the root,
    the kept token and the grafted tokens), the acceptance stopping there."""
    args = _args(tiny_models, "--speculative-graft-checkpoint-depths", "0", "--speculative-graft-thresholds", "0.0001",
                 "--speculative-graft-ragged", "on")
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "graft-dflash-kept.log",
                      env=pinned_env(tmp_path_factory.mktemp("pinned-kept"))) as srv:
        outs = [srv.generate_ids(p, NEW_TOKENS) for p in (PROMPTS[0], PROMPTS[3])]
        info = _graft_info(srv)
    assert [o["output_ids"] for o in outs] == [reference[0], reference[3]]
    block = info["block"]
    drafted = block["steps"] - block["guarded_batch_steps"]  # one request a step; the draft guard's probes draft none
    assert block["kept_tokens"] == drafted > 0 and block["guarded_batch_steps"] > 0, block
    assert block["verified_rows"] == block["steps"] + sum(o["meta_info"]["graft_proposed"] for o in outs)
    assert 2 * drafted <= block["verified_rows"] < block["steps"] * DFLASH_BLOCK, block  # root + kept, at least
    for o in outs:  # SGLang counts the slots its acceptance saw (the cut positions are -1)
        assert o["meta_info"]["graft_proposed"] == o["meta_info"]["spec_num_proposed_drafts"], o["meta_info"]
    run = outs[0]["meta_info"]
    assert run["graft_draft_accepted"] > 0 and run["graft_retrieved_accepted"] > 0, run


@pytest.mark.server
def test_batched_whole_blocks_as_cuda_resolves_them(tiny_models, server_logs, reference, tmp_path_factory):
    """The block mode as a CUDA target resolves it, forced on a CPU: ``--speculative-graft-ragged
    off`` verifies every row of every block in batches too (SGLang's DFLASH verify has no
    per-request length there), so the plain guard never acts and only the draft guard's probes
    (timing pinned) leave the draft out. Token-exact batched; whole blocks; retrieved tokens
    accepted on the loops."""
    args = _args(tiny_models, "--speculative-graft-ragged", "off")
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "graft-dflash-whole.log",
                      env=pinned_env(tmp_path_factory.mktemp("pinned-whole"))) as srv:
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            outs = list(pool.map(lambda p: srv.generate_ids(p, NEW_TOKENS), PROMPTS))
        info = _graft_info(srv)
    assert [o["output_ids"] for o in outs] == reference
    block = info["block"]
    assert block["verified_rows"] == block["steps"] * DFLASH_BLOCK, block
    assert block["plain_batch_steps"] == 0 and block["batch_steps"] < block["steps"], block  # batched, never plain
    # the draft guard's probes (steps 8, 16, ... of a bucket): the draft left out; retrieval's confidence may add more
    assert 0 < block["guarded_batch_steps"] <= min(block["undrafted_batch_steps"], block["batch_steps"] // 8), block
    assert info["rate_guard"] == {"draft": {}, "plain": {}}, info["rate_guard"]
    metas = [o["meta_info"] for o in outs]
    for meta in metas:
        assert meta["graft_proposed"] == meta["spec_verify_ct"] * M == meta["spec_num_proposed_drafts"], meta
    assert sum(m["graft_retrieved_accepted"] for m in metas[2:]) > 0


@pytest.mark.server
def test_blocks_of_retrieved_chains_alone_without_a_draft_forward(tiny_models, server_logs, reference,
                                                               tmp_path_factory):
    """``--speculative-graft-skip-draft-tokens 0``: every chain is expected to give enough, so no step
    runs the draft forward or the pick; each block holds its request's retrieved chain alone (the slots
    past it token 0, verified in a whole block alone, left out in a batch). Token-exact alone and
    batched; no draft token accepted, retrieved ones accepted on the loops. The rate guard times no
    step (``pinned_env``): a loaded machine's timings cannot make the steps plain."""
    args = _args(tiny_models, "--speculative-graft-skip-draft-tokens", "0")
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "graft-dflash-undrafted.log",
                      env=pinned_env(tmp_path_factory.mktemp("pinned-undrafted"))) as srv:
        alone = [srv.generate_ids(p, NEW_TOKENS) for p in PROMPTS]
        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda p: srv.generate_ids(p, NEW_TOKENS), PROMPTS))
        info = _graft_info(srv)
    assert [o["output_ids"] for o in alone] == reference
    assert [o["output_ids"] for o in together] == reference
    block = info["block"]
    assert block["undrafted_batch_steps"] == block["batch_steps"] > 0 and block["kept_tokens"] == 0, block
    assert block["verified_rows"] < block["steps"] * DFLASH_BLOCK  # the batched blocks cut after their chains
    metas = [o["meta_info"] for o in alone + together]
    assert all(m["graft_draft_accepted"] == 0 for m in metas)
    assert sum(m["graft_retrieved_accepted"] for m in metas) > 0


# -- sampled verify: the target's distribution ----------------------------------------------------
SAMPLED_TOKENS = 4  # token 1 from the prefill, tokens 2-4 from the first verify steps
SAMPLED_PROMPTS = [DFLASH_RUN_PROMPT, REPETITIVE[0]]  # little retrieved (short verifies); retrieved ones accepted
GRAFT_SAMPLES, PLAIN_SAMPLES = 500, 250  # per prompt and case
MASS_BINS = 10


def _sample(srv, prompt, sampling: dict, n: int) -> list[dict]:
    """``n`` independent samples of ``SAMPLED_TOKENS`` tokens (SGLang ignores ``sampling_seed``
    without ``--enable-deterministic-inference``, so none is sent; every request draws its own
    coins)."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": SAMPLED_TOKENS, "ignore_eos": True,
                                                     **sampling}}

    def one(_):
        r = requests.post(srv.url + "/generate", json=body, timeout=300)
        r.raise_for_status()
        return r.json()

    with cf.ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(n)))


@pytest.fixture(scope="module")
def target_model(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()


def _target_probs(model, prompt, outputs: torch.Tensor, sampling: dict) -> torch.Tensor:
    """The exact target distributions ``[n, L - 1, V] float64`` of tokens 2..L of each sample
    (``outputs [n, L]``) given its own prompt and earlier tokens: float32 logits (transformers),
    temperature and top-k (by rank, as SGLang's sampler on a CPU) applied in float64."""
    n, length = outputs.shape
    ids = torch.cat([torch.tensor(prompt).expand(n, -1), outputs[:, :-1]], dim=1)
    rows = []
    with torch.no_grad():
        for lo in range(0, n, 256):
            logits = model(ids[lo:lo + 256]).logits[:, len(prompt):].double()
            rows.append(logits / sampling.get("temperature", 1.0))
    logits = torch.cat(rows)
    top_k = sampling.get("top_k", -1)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).indices
        logits = torch.full_like(logits, float("-inf")).scatter(-1, kth, logits.gather(-1, kth))
    return logits.softmax(-1)


def _mass_bin_counts(probs: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Observed and expected counts ``[L - 1, MASS_BINS]`` of each position's sampled token by the
    target mass of the tokens ranked above it (``probs [n, L - 1, V]``, ``tokens [n, L - 1]``).

    A token whose rivals above it hold mass ``c`` falls in bin ``floor(c * MASS_BINS)``; given its
    prefix the sampled token falls in bin ``k`` with the target mass of bin ``k``'s tokens, so the
    expected count is that mass summed over the samples. Greedy verify puts every verified token in
    bin 0; a near-uniform target spreads them over all bins."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    above = sorted_probs.cumsum(-1) - sorted_probs
    bins_sorted = (above * MASS_BINS).floor().clamp(max=MASS_BINS - 1).long()
    bins = torch.empty_like(bins_sorted).scatter_(-1, order, bins_sorted)  # each token's bin
    outside = probs.gather(-1, tokens[..., None])[..., 0] == 0
    assert not outside.any(), f"tokens the target gives no mass: {tokens[outside][:5].tolist()}"
    zeros = torch.zeros(probs.shape[1], MASS_BINS, dtype=torch.float64)
    positions = probs.shape[1]
    expected = zeros.clone().scatter_add_(1, bins.transpose(0, 1).reshape(positions, -1),
                                          probs.transpose(0, 1).reshape(positions, -1))
    sampled = bins.gather(-1, tokens[..., None])[..., 0]
    observed = zeros.clone().scatter_add_(1, sampled.T, torch.ones_like(sampled.T, dtype=torch.float64))
    return observed, expected


def _fit_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``observed`` against ``expected`` (``[positions, bins]``):
    per position, bins expected fewer than 10 times pooled into one cell; degrees of freedom the
    cells less one per position (given its prefix each position's bin is one multinomial draw, and
    the positions' deviations are uncorrelated)."""
    from scipy.stats import chi2

    stat, dof = 0.0, 0
    for obs, exp in zip(observed.tolist(), expected.tolist()):
        big = [i for i, e in enumerate(exp) if e >= 10]
        cells = [(obs[i], exp[i]) for i in big]
        rest = (sum(obs) - sum(o for o, _ in cells), sum(exp) - sum(e for _, e in cells))
        if rest[1] > 1e-9:
            cells.append(rest)
        stat += sum((o - e) ** 2 / e for o, e in cells)
        dof += len(cells) - 1
    return float(chi2.sf(stat, dof))


@pytest.mark.server
@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 1.0, "top_k": 2}],
                         ids=["temperature-1", "top-k-2"])
def test_sampled_tokens_follow_the_target_distribution(block_server, plain_llama, target_model, sampling):
    """Tokens 2-4 of sampled requests, GRAFT over DFlash and no speculation, fit the target's
    distribution given each sample's own prefix (chi-square over the target-mass bins of
    :func:`_mass_bin_counts`, per position; 1,000 GRAFT and 500 plain samples, a 1e-4 threshold).
    Every step is verified by sampling, of its root and grafted chain only (the blocks cut after
    them); under top-k 2 the blocks hold grafted tokens (the loop's retrieved continuations are
    accepted)."""
    before = _graft_info(block_server)["block"]
    counts = {"graft": [], "plain": []}
    metas = []
    for prompt in SAMPLED_PROMPTS:
        for name, srv, n in (("graft", block_server, GRAFT_SAMPLES), ("plain", plain_llama, PLAIN_SAMPLES)):
            outs = _sample(srv, prompt, sampling, n)
            tokens = torch.tensor([o["output_ids"] for o in outs])
            assert tokens.shape == (n, SAMPLED_TOKENS)
            probs = _target_probs(target_model, prompt, tokens, sampling)
            counts[name].append(_mass_bin_counts(probs, tokens[:, 1:]))
            metas += [o["meta_info"] for o in outs] if name == "graft" else []
    after = _graft_info(block_server)["block"]
    fits = {}
    for name, pairs in counts.items():
        observed, expected = (sum(c[i] for c in pairs) for i in (0, 1))
        fits[name] = (_fit_p_value(observed, expected), observed.tolist(), expected.round().tolist())
    print(f"\nsampled {sampling}: chi-square p-values graft {fits['graft'][0]:.3g}, plain {fits['plain'][0]:.3g}")
    assert fits["plain"][0] > 1e-4, fits["plain"]  # the reference: no speculation fits the target
    assert fits["graft"][0] > 1e-4, fits["graft"]
    assert {m["graft_verify"] for m in metas} == {"sampling"}
    log = block_server.tail(10 ** 8)  # neither GRAFT's start-up warning nor SGLang's greedy fallback
    assert "no sampled DFLASH verify" not in log and "falling back to greedy" not in log
    steps = after["steps"] - before["steps"]
    assert before["verified_rows"] + steps <= after["verified_rows"] < before["verified_rows"] + steps * DFLASH_BLOCK
    if "top_k" in sampling:  # at temperature 1 the first sampled token rarely recurs in the context, so
        # retrieval seldom has a chain to graft (none at all in some runs): only top-k 2 reliably grafts
        assert after["grafted_tokens"] > before["grafted_tokens"]  # grafted tokens were verified by sampling
        assert sum(m["graft_retrieved_accepted"] for m in metas[GRAFT_SAMPLES:]) > 0  # the loop's


# -- the rule on tensors (no server) ----------------------------------------------------------------
def test_depth_thresholds_step_at_the_checkpoints():
    assert depth_thresholds((0, 1, 5), (0.35, 0.25, 0.15), 7).tolist() == pytest.approx(
        [0.35, 0.25, 0.25, 0.25, 0.25, 0.15, 0.15])
    assert depth_thresholds((2,), (0.5,), 4).tolist() == [0.5] * 4  # above the first checkpoint: its threshold
    with pytest.raises(ValueError):
        depth_thresholds((0, 1), (0.5,), 4)


def test_kept_prefix_is_where_the_cumulative_confidence_stays_above_the_threshold():
    conf = torch.tensor([[0.9, 0.8, 0.6, 1.0], [0.4, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.9, 0.5, 1.0, 0.99]])
    # cumulative: [.9 .72 .43 .43], [.4 ...], [1 1 1 1], [.9 .45 .45 .4455]
    assert kept_lengths(conf, torch.full((4,), 0.5)).tolist() == [2, 0, 4, 1]
    steps = torch.tensor([0.5, 0.4, 0.4, 0.4])  # a looser threshold from depth 1 on
    assert kept_lengths(conf, steps).tolist() == [4, 0, 4, 4]


def test_best_chain_follows_the_highest_priority_child():
    # anchor -> a (0.9) -> b (0.8) -> c (0.5); anchor -> x (0.3); a -> y (0.1); row 2: nothing valid
    tokens = torch.tensor([[10, 20, 11, 30, 12], [0, 0, 0, 0, 0]])
    parents = torch.tensor([[-1, -1, 0, 0, 2], [-1, -1, -1, -1, -1]])
    priority = torch.tensor([[0.9, 0.3, 0.8, 0.1, 0.5], [0.0] * 5])
    valid = torch.tensor([[True] * 5, [False] * 5])
    chain, ok, index = best_chain(RetrievalProposals(tokens, parents, priority, valid), 4)
    assert chain.tolist() == [[10, 11, 12, 0], [0, 0, 0, 0]]
    assert ok.tolist() == [[True, True, True, False], [False] * 4]
    assert index.tolist() == [[0, 2, 4, -1], [-1] * 4]  # each chain node's column in the proposals


def test_a_chain_is_expected_to_give_its_values_capped_by_their_ancestors():
    values = torch.tensor([[0.9, 0.95, 0.5, 0.7], [0.9, 0.95, 0.5, 0.7], [0.2, 0.9, 0.9, 0.9]])
    valid = torch.tensor([[True] * 4, [True, True, False, False], [True] * 4])
    assert chain_expected(values, valid).tolist() == pytest.approx([2.8, 1.8, 0.8])
    assert chain_expected(values[:, :0], valid[:, :0]).tolist() == [0.0, 0.0, 0.0]


def test_chain_feedback_counts_the_verified_and_the_accepted_chain_nodes():
    # chain node j sits in draft slot kept + j; a row is verified below lens - 1 slots
    kept = torch.tensor([1, 0, 0, 2])
    valid = torch.tensor([[True, True, True], [True, True, False], [True, True, True], [False] * 3])
    lens = torch.tensor([4, 8, 8, 3])  # rows, the root included
    accepted = torch.tensor([2, 1, 3, 2])  # draft slots accepted
    shown, acc = chain_feedback(kept, valid, lens, accepted)
    assert shown.tolist() == [[True, True, False], [True, True, False], [True] * 3, [False] * 3]
    assert acc.tolist() == [[True, False, False], [True, False, False], [True] * 3, [False] * 3]


def test_graft_fills_the_freed_slots_and_keeps_the_draft_where_retrieval_has_nothing():
    draft = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]])
    kept = torch.tensor([2, 0, 7])
    chain = torch.tensor([[40, 50, 60], [1, 90, 0], [8, 8, 8]])
    ok = torch.tensor([[True, True, True], [True, True, False], [True, True, True]])
    block, retrieved = graft_block(draft, kept, chain, ok)
    assert block.tolist() == [[1, 2, 40, 50, 60, 6, 7], [1, 90, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]]
    # a retrieved token equal to the draft's counts as the draft's
    assert retrieved.int().tolist() == [[0, 0, 1, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0, 0], [0] * 7]
    from_retrieval, from_draft = accepted_provenance(retrieved, torch.tensor([4, 1, 7]))
    assert from_retrieval.tolist() == [2, 0, 0] and from_draft.tolist() == [2, 1, 7]
    empty = graft_block(draft, kept, chain[:, :0], ok[:, :0])
    assert torch.equal(empty[0], draft) and not empty[1].any()


class _TwoRanks:
    """Rank ``rank`` of a two-rank group whose ``all_gather_into_tensor`` exchanges through threads,
    as SGLang's tensor-parallel group does through its ranks' processes."""

    world_size = 2

    def __init__(self, rank: int, slots: list, barrier) -> None:
        self.rank, self.slots, self.barrier = rank, slots, barrier

    def all_gather_into_tensor(self, out: torch.Tensor, local: torch.Tensor) -> None:
        self.slots[self.rank] = local.clone()
        self.barrier.wait()
        out.copy_(torch.cat(self.slots))
        self.barrier.wait()  # both ranks have read before either writes its next tensor


def test_block_confidences_are_the_whole_vocabularys_on_every_tensor_parallel_rank():
    """The block's greedy tokens and confidences at TP 2, each rank holding half of a padded lm_head
    (the padding rows' logits the largest, so a shard's padding must stay out): both ranks return the
    whole vocabulary's greedy token and softmax probability, bit-equal across the ranks, over more
    rows than one of SGLang's chunks; a tie across the shards goes to the first rank's token, as
    SGLang's DFLASH head picks it."""
    import threading

    from sglang_graft.sglang.block_pick import greedy_with_confidence

    g = torch.Generator().manual_seed(0)
    vocab, half, padded, hidden, rows = 1000, 500, 512, 16, 300
    weight = torch.randn(vocab, hidden, generator=g)
    weight[10] = weight[half + 10] = 10 * weight[10] / weight[10].norm()  # tokens 10 (rank 0) and 510 (rank 1)
    states = torch.randn(rows, hidden, generator=g)
    states[0] = weight[10] / 2  # ... tie at row 0's largest logit (50; any other is at most 5 |w|)
    whole = states @ weight.T
    probs = torch.softmax(whole, dim=-1)
    heads = []
    for rank in range(2):
        shard = torch.cat([weight[rank * half:(rank + 1) * half], torch.full((padded - half, hidden), 100.0)])
        heads.append(SimpleNamespace(weight=shard, shard_indices=SimpleNamespace(
            num_org_elements=half, num_org_elements_padded=padded, org_vocab_start_index=rank * half,
            num_added_elements=0)))
    slots, barrier, out = [None, None], threading.Barrier(2), [None, None]

    def run(rank):
        out[rank] = greedy_with_confidence(states, heads[rank], 256, _TwoRanks(rank, slots, barrier))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    (tokens0, conf0), (tokens1, conf1) = out
    assert torch.equal(tokens0, tokens1) and torch.equal(conf0, conf1)
    assert tokens0.tolist() == whole.argmax(dim=-1).tolist() and int(tokens0[0]) == 10
    torch.testing.assert_close(conf0, probs.max(dim=-1).values, rtol=1e-5, atol=1e-7)
    # one rank holding the whole head (no shard): the same tokens and confidences
    alone = greedy_with_confidence(states, SimpleNamespace(weight=weight), 256)
    assert torch.equal(alone[0], tokens0)
    torch.testing.assert_close(alone[1], conf0, rtol=1e-5, atol=1e-7)


def test_the_roots_are_asked_first_while_a_whole_batch_may_be_confident():
    """Retrieval is valued at the roots before the draft at batch 1, until 32 requests have been
    valued, one batch step in 16, and where the share of confident requests so far, to the power of
    the batch size, is at least 1 % (every request of a batch must be confident to leave the draft out)."""
    from sglang_graft.sglang.block_worker import BlockCounters, GraftDFlashWorker

    worker = GraftDFlashWorker.__new__(GraftDFlashWorker)  # the rule only: no server
    worker.block_counters = BlockCounters(batch_steps=5)
    worker.asked_requests, worker.confident_requests = 10, 0
    assert worker._worth_asking(8)  # fewer than 32 valued
    worker.asked_requests, worker.confident_requests = 100, 50
    assert worker._worth_asking(1) and worker._worth_asking(6)  # 0.5 ** 6 = 0.016
    assert not worker._worth_asking(7)  # 0.5 ** 7 = 0.008
    worker.block_counters.batch_steps = 16
    assert worker._worth_asking(7)  # one batch step in 16 asks anyway


def _guarded_worker(verify_rows_from):
    """A block worker with the decision's state only (no server), every measured input given:
    retrieval's root chains (``worker.expected``: what each is expected to give) and the guards."""
    from sglang_graft.engine.rate_guard import RateGuard
    from sglang_graft.sglang.block_worker import GUARD_MIN_STEPS, BlockCounters, GraftDFlashWorker

    worker = GraftDFlashWorker.__new__(GraftDFlashWorker)
    worker.block_counters = BlockCounters()
    worker.asked_requests = worker.confident_requests = 0
    worker.graft_cfg = SimpleNamespace(skip_draft_tokens=3.0)
    worker.block_size, worker.verify_rows_from, worker.all_reduce_sum = 4, verify_rows_from, None
    worker.draft_guard, worker.plain_guard = RateGuard(min_steps=GUARD_MIN_STEPS), RateGuard(min_steps=GUARD_MIN_STEPS)
    worker.chains = torch.tensor([[4, 5, 0]]), torch.tensor([[True, True, False]]), torch.zeros(1, 3, dtype=torch.int64)
    worker.expected = 1.0
    worker._root_chains = lambda step: (*worker.chains, torch.full((len(step.rids),), worker.expected))
    return worker


def _decide(worker, n, bs=1):
    from sglang_graft.sglang.block_worker import BlockStep

    steps = [BlockStep(rids=list(range(bs)), bonus=torch.ones(bs, dtype=torch.int64)) for _ in range(n)]
    return steps, [worker._undrafted(step) for step in steps]


def _publish(worker, bs, committed_by_kind, rounds=4):
    """``rounds`` of one timed step of each kind in turn at ``bs`` (committed tokens in 0.1 s), so
    that the guards pair them, then a publication."""
    from sglang_graft.sglang.block_step import BlockStep

    for _ in range(rounds):
        for kind, committed in committed_by_kind.items():
            step = BlockStep(rids=list(range(bs)), bonus=torch.ones(bs, dtype=torch.int64),
                             drafted=kind == "drafted", guarded=kind != "drafted", plain=kind == "plain")
            worker._time_step(step, committed=committed, seconds=0.1)
    worker.block_counters.batch_steps = 0  # a publishing step
    worker._time_step(BlockStep(rids=[], bonus=None, drafted=False), committed=0, seconds=0.1)


def test_the_draft_is_left_out_where_steps_with_it_realized_fewer_tokens_per_second():
    """The block mode's draft-or-not decision (``_undrafted``), its measured inputs given, at batch 1
    (whole blocks verified, so no plain guard): a batch whose every chain is confident leaves the draft
    out for that reason (timed by no guard); otherwise the draft guard's probes leave it out one step
    in 8 while the bucket's rate without it is unmeasured; once steps with the draft realized fewer
    tokens per second than steps with the chains alone, 7 steps in 8 leave it out (the 8th drafts)."""
    worker = _guarded_worker(verify_rows_from=2)
    worker.expected = 3.0  # confident: left out for retrieval's confidence, not by a guard
    (step,), (undrafted,) = _decide(worker, 1)
    assert undrafted and not step.drafted and not step.guarded and torch.equal(step.chain, worker.chains[0])
    worker._time_step(step, committed=4, seconds=0.1)
    assert worker.draft_guard._last is None and worker.plain_guard._last is None
    worker.expected = 1.0
    steps, undrafted = _decide(worker, 16)
    assert [i + 1 for i, u in enumerate(undrafted) if u] == [8, 16]  # probes: the rate without the draft unknown
    assert all(s.guarded == u and s.drafted != u and not s.plain for s, u in zip(steps, undrafted))
    for step in steps[:8]:
        worker._time_step(step, committed=2 if step.drafted else 3, seconds=0.1)
    assert worker.draft_guard.pairs.count[0] == 1  # bucket bs 1: the 7th drafted step and the chains' step
    assert worker.plain_guard.pairs.count[0] == 0 and worker.plain_guard._last[:2] == (1, False)  # drafted: preferred
    _publish(worker, 1, {"drafted": 2, "chains": 3})  # 20 against 30 tokens per second
    assert worker.draft_guard.speculation_loses(1) and not worker.plain_guard.speculation_loses(1)
    steps, undrafted = _decide(worker, 16)
    assert [i + 1 for i, u in enumerate(undrafted) if not u] == [8, 16]  # the draft guard's probes draft
    assert all(s.guarded and not s.plain for s, u in zip(steps, undrafted) if u)
    timed = []
    worker.plain_guard.observe = lambda **step: timed.append(step["plain"])
    for step in steps:  # drafting loses now: the plain guard times the chains' steps only
        worker._time_step(step, committed=2, seconds=0.1)
    assert timed == [False] * 14


def test_a_step_is_plain_where_speculating_realized_fewer_tokens_per_second_than_plain_steps():
    """Where blocks are cut after their rows (a batch of 2 here), the plain guard comes first: its probes
    make one step in 8 plain (the roots alone: no chain, one verified row each) while plain steps are
    unmeasured; once steps that speculated realized fewer tokens per second, 7 in 8 are plain. A
    batch below the cut (here 1) is never plain: its whole block is verified anyway."""
    worker = _guarded_worker(verify_rows_from=2)
    worker.chains = tuple(t.expand(2, -1) for t in worker.chains)
    steps, _ = _decide(worker, 16, bs=2)
    assert [i + 1 for i, s in enumerate(steps) if s.plain] == [8, 16]
    for step in steps:
        if step.plain:
            assert not step.drafted and step.guarded and not step.chain_valid.any() and step.chain.shape == (2, 3)
    # step 8 was plain, so the draft guard's 8th ask is step 9
    assert [i + 1 for i, s in enumerate(steps) if s.guarded and not s.plain] == [9]
    _publish(worker, 2, {"drafted": 3, "chains": 3, "plain": 4})
    assert worker.plain_guard.speculation_loses(2) and worker.plain_guard.speculation_loses(3)
    steps, _ = _decide(worker, 16, bs=2)
    assert [i + 1 for i, s in enumerate(steps) if not s.plain] == [8, 16]  # the plain guard's probes speculate
    steps, _ = _decide(worker, 8, bs=1)
    assert not any(s.plain for s in steps)


def test_plain_steps_are_compared_with_the_kind_a_step_would_now_take():
    """The plain guard's speculative steps are those of the kind the draft guard prefers; where that
    preference changes (drafting loses to the chains alone), its pairs of plain and drafted steps are
    forgotten, so plain steps (30 tokens a second here) are not judged against the dropped drafted ones
    (10) but against the chains' (40), and the batch steps speculate. (Kept, the old pairs would
    outweigh the new: speculation would lose.)"""
    worker = _guarded_worker(verify_rows_from=2)
    worker.chains = tuple(t.expand(2, -1) for t in worker.chains)
    _publish(worker, 2, {"drafted": 1, "plain": 3})  # the draft guard has no chains steps yet: drafting preferred
    assert worker.plain_guard.speculation_loses(2) and not worker.draft_guard.speculation_loses(2)
    _publish(worker, 2, {"drafted": 1, "chains": 4})  # drafting loses now: the plain guard's pairs are dropped
    assert worker.draft_guard.speculation_loses(2) and not worker.plain_guard.speculation_loses(2)
    assert worker.plain_guard.pairs.count[1] == 0  # bucket bs 2-3
    _publish(worker, 2, {"chains": 4, "plain": 3})  # the chains' steps: the plain guard's speculative kind
    assert worker.plain_guard.as_dict()["bs2"] == {"plain": 30.0, "speculative": 40.0}
    steps, _ = _decide(worker, 8, bs=2)
    assert not any(s.plain for s in steps) and sum(s.drafted for s in steps) == 1  # the draft guard's probe


def test_verify_rows_are_the_root_the_kept_prefix_and_the_grafted_chain():
    """The docstring example of ``verify_lengths``, and SGLang's greedy chain acceptance on a block
    cut after its verified rows: it stops within them whatever the target chose past them, and the
    bonus is a verified row's choice."""
    from sglang.kernels.ops.speculative.dflash import compute_dflash_correct_drafts_and_bonus

    kept = torch.tensor([7, 2, 0])
    valid = torch.tensor([[False] * 3, [True] * 3, [False] * 3])
    assert verify_lengths(kept, valid, 7).tolist() == [8, 6, 1]
    assert verify_lengths(torch.tensor([5]), torch.tensor([[True] * 4]), 7).tolist() == [8]  # chain clipped
    assert verify_lengths(kept, valid[:, :0], 7).tolist() == [8, 3, 1]
    block = torch.tensor([[9, 1, 2, 3, 4], [9, 1, 2, 3, 4], [9, 1, 2, 3, 4]])
    target = torch.tensor([[1, 2, 3, 4, 5]] * 3)  # the target agrees with the whole block
    lens = torch.tensor([5, 3, 1])
    cut = cut_after(block, lens)
    assert cut.tolist() == [[9, 1, 2, 3, 4], [9, 1, 2, -1, -1], [9, -1, -1, -1, -1]]
    accepted, bonus = compute_dflash_correct_drafts_and_bonus(candidates=cut, target_predict=target)
    assert accepted.tolist() == [4, 2, 0] and bonus.tolist() == [5, 3, 1]


# -- the torch op under SGLang's chain verify (no server) -------------------------------------------
def _kernel_chain(candidates, probs, coins, final_coins):
    """``tree_speculative_sampling_target_only`` (``sgl_kernel/speculative/sampling.cuh``) for the
    chain DFLASH hands it, one request at a time in scalar Python: accept child ``j`` of the last
    accepted node where its target mass is positive and ``coin < mass``, the coin then becoming
    child ``j``'s; at the first rejection sample from the last accepted node's row with the rejected
    token's mass removed (``relu(q - p)``, ``p`` its mass only), after every child from the full
    row; inverse CDF with the final coin, the last positive token where rounding leaves none.

    Returns ``(accept_len [bs], bonus [bs])``."""
    bs, n, vocab = probs.shape
    accepted, bonuses = [], []
    for b in range(bs):
        cur, coin, rejected = 0, float(coins[b, 0]), None
        for j in range(1, n):
            token = int(candidates[b, j])
            mass = float(probs[b, cur, token])
            if mass > 0 and coin < mass:
                cur, coin = j, float(coins[b, j])
            else:
                rejected = token
                break
        row = probs[b, cur].tolist()
        if rejected is not None:
            row[rejected] = 0.0
        u, total, bonus, last = float(final_coins[b]) * sum(row), 0.0, None, vocab - 1
        for i, q in enumerate(row):
            if q > 0:
                total, last = total + q, i
                if total > u:
                    bonus = i
                    break
        accepted.append(cur)
        bonuses.append(last if bonus is None else bonus)
    return torch.tensor(accepted), torch.tensor(bonuses)


@pytest.mark.parametrize("top_k", [0, 3], ids=["full-vocab", "top-k"])
def test_the_torch_op_verifies_sglangs_chain_as_the_kernel_does(top_k):
    """SGLang's own chain-sampling verify (``compute_dflash_sampling_correct_drafts_and_bonus``, its
    chain buffers: ``retrive_index`` the rows ``b * B + i``, ``retrive_next_token`` ``i + 1``,
    no siblings) run under :func:`sampling.torch_sampled_verify` gives, coin for coin, what the
    CUDA kernel's rule gives on the same target probabilities: rejections at every depth, whole
    blocks accepted, with and without SGLang's sparse top-k path. The seams are restored after,
    and a verify step whose op is never called fails loudly."""
    from sglang.srt.speculative import dflash_utils
    from sglang_graft.sglang import sampling, seams

    g = torch.Generator().manual_seed(3)
    bs, block, vocab = 64, DFLASH_BLOCK, 12
    candidates = torch.randint(0, vocab, (bs, block), generator=g)
    logits = torch.randn(bs, block, vocab, generator=g)
    # make the next candidate likely at a growing share of the rows, so the walk goes deep
    boost = (torch.rand(bs, block, generator=g) < torch.linspace(0.2, 1.0, bs)[:, None]).float() * 4.0
    nxt = torch.cat([candidates[:, 1:], candidates[:, :1]], dim=1)
    logits.scatter_add_(2, nxt[..., None], boost[..., None])
    logits = logits.reshape(bs * block, vocab)
    info = SimpleNamespace(temperatures=torch.full((bs, 1), 0.9), top_ks=torch.full((bs,), top_k or vocab),
                           top_ps=torch.ones(bs), need_top_k_sampling=top_k > 0, need_top_p_sampling=False)
    coins, final_coins = torch.rand(bs, block, generator=g), torch.rand(bs, generator=g)
    original = dflash_utils.tree_speculative_sampling_target_only
    flag, step_check = dflash_utils._DFLASH_SAMPLING_VERIFY_AVAILABLE, seams.DFLASH_STEP_SAMPLING_VERIFY.resolve()
    with sampling.torch_sampled_verify(True, verifies=True):
        accept_len, bonus = dflash_utils.compute_dflash_sampling_correct_drafts_and_bonus(
            candidates=candidates, next_token_logits=logits.clone(), sampling_info=info, threshold_single=1.0,
            threshold_acc=1.0, uniform_samples=coins, uniform_samples_for_final_sampling=final_coins)
    assert dflash_utils.tree_speculative_sampling_target_only is original  # restored (None on a CPU)
    assert seams.DFLASH_SAMPLING_AVAILABLE.resolve() is flag
    assert seams.DFLASH_STEP_SAMPLING_VERIFY.resolve() is step_check
    probs = dflash_utils.build_speculative_verify_target_probs(
        next_token_logits=logits, sampling_info=info, draft_token_num=block, bs=bs)
    want_len, want_bonus = _kernel_chain(candidates, probs, coins, final_coins)
    assert accept_len.tolist() == want_len.tolist() and bonus.tolist() == want_bonus.tolist()
    lengths = set(want_len.tolist())
    assert {0, block - 1} <= lengths and len(lengths) >= 4  # rejected early, late, and never
    with pytest.raises(seams.SeamError, match="tree_speculative_sampling_target_only: was not called"):
        with sampling.torch_sampled_verify(True, verifies=True):
            pass
    with sampling.torch_sampled_verify(False, verifies=True):  # inactive: SGLang's names untouched
        assert dflash_utils.tree_speculative_sampling_target_only is original


def test_a_cut_chain_is_verified_as_the_chain_of_its_verified_rows():
    """A sampled verify of blocks cut after their verified rows (``cut_after``; the op
    ``sampling.chain_sampling_verify``) gives, coin for coin, what the kernel's rule gives on
    each request's chain of its verified rows alone: at most ``L - 1`` draft tokens accepted, the
    next token sampled from row ``L - 1`` (the full row when every verified token was accepted)."""
    from sglang.srt.speculative import dflash_utils
    from sglang_graft.sglang import sampling

    g = torch.Generator().manual_seed(5)
    bs, block, vocab = 48, DFLASH_BLOCK, 10
    candidates = torch.randint(0, vocab, (bs, block), generator=g)
    nxt = torch.cat([candidates[:, 1:], candidates[:, :1]], dim=1)
    logits = torch.randn(bs, block, vocab, generator=g).scatter_add_(2, nxt[..., None], torch.full((bs, block, 1), 5.0))
    logits = logits.reshape(bs * block, vocab)
    info = SimpleNamespace(temperatures=torch.full((bs, 1), 1.0), top_ks=torch.full((bs,), vocab),
                           top_ps=torch.ones(bs), need_top_k_sampling=False, need_top_p_sampling=False)
    coins, final_coins = torch.rand(bs, block, generator=g), torch.rand(bs, generator=g)
    lens = torch.randint(1, block + 1, (bs,), generator=g)
    with sampling.torch_sampled_verify(True, verifies=True):
        accept_len, bonus = dflash_utils.compute_dflash_sampling_correct_drafts_and_bonus(
            candidates=cut_after(candidates, lens), next_token_logits=logits.clone(), sampling_info=info,
            threshold_single=1.0, threshold_acc=1.0, uniform_samples=coins, uniform_samples_for_final_sampling=final_coins)
    probs = dflash_utils.build_speculative_verify_target_probs(
        next_token_logits=logits, sampling_info=info, draft_token_num=block, bs=bs)
    want = [_kernel_chain(candidates[b:b + 1, :n], probs[b:b + 1, :n], coins[b:b + 1, :n], final_coins[b:b + 1])
            for b, n in enumerate(lens.tolist())]
    assert accept_len.tolist() == [int(w[0]) for w in want] and bonus.tolist() == [int(w[1]) for w in want]
    assert (accept_len <= lens - 1).all() and bool((accept_len == lens - 1).any()) and bool((lens < block).any())


# -- selection by the draft's type ----------------------------------------------------------------
def test_the_draft_type_selects_the_block_mode(tiny_models, monkeypatch):
    from sglang_graft import config as graft_config
    from sglang_graft.sglang import algorithm, launch_config

    def args(path):
        return SimpleNamespace(speculative_draft_model_path=str(path) if path else None, trust_remote_code=False,
                               decrypted_draft_config_file=None)

    assert algorithm.draft_kind_of(args(tiny_models["llama-dflash"])) == launch_config.DFLASH
    assert algorithm.draft_kind_of(args(tiny_models["llama-eagle3"])) == launch_config.EAGLE3
    assert algorithm.draft_kind_of(args(None)) == launch_config.EAGLE3
    monkeypatch.delenv(launch_config.CONFIG_ENV, raising=False)
    monkeypatch.setattr(launch_config, "_launch_config", None)
    monkeypatch.setattr(launch_config, "_draft_kind", None)
    spec = algorithm.GraftAlgorithm("GRAFT", algorithm._factory)
    cfg = graft_config.GraftConfig(source="sam")
    launch_config.set_config(cfg)  # a launch that has not resolved its draft yet: EAGLE-3's answers
    assert spec.is_eagle3() and spec.need_topk() and not spec.is_dflash_family()
    launch_config.set_config(cfg, launch_config.DFLASH)
    assert spec.is_dflash() and spec.is_dflash_family() and not spec.is_eagle() and not spec.need_topk()
    monkeypatch.setattr(launch_config, "_launch_config", None)  # a started process: from the environment
    monkeypatch.setattr(launch_config, "_draft_kind", None)
    assert launch_config.draft_kind() == launch_config.DFLASH and launch_config.config_of() == cfg
    launch_config.set_config(cfg, launch_config.EAGLE3)
    assert spec.is_eagle() and spec.is_eagle3() and not spec.is_dflash()

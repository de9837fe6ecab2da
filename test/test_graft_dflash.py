"""GRAFT with a DFlash block draft, chain-grafted (``sglang_graft.sglang.block_worker``): selected by
the draft's type (``--speculative-algorithm GRAFT`` with the tiny ``DFlashDraftModel``), token-exact
against the tiny Llama served without speculation, alone, batched and on edge requests, with
retrieved tokens accepted on repetitive prompts and the draft's own block on ``DFLASH_RUN_PROMPT``;
sampled requests (temperature 1, and top-k 2) verified by sampling, also on a CPU, their tokens
fitting the target's distribution as no speculation's do. The block mode's rules on tensors, and the
torch op of SGLang's chain-sampling verify on a CPU, are tested without a server in
``test_block_graft.py``.

The tiny draft's confidences are about 7e-4 at every position (its aimed norm gains lift one token a
little above a 4096-token vocabulary), so with the default thresholds every block is pruned to the
root and retrieval fills it. The first server verifies whole blocks one request at a time and, in
batches, each block up to its grafted chain (the CPU default); the second keeps one draft token per
block (one checkpoint at depth 0, threshold 1e-4), grafts after it (the re-rooted retrieval path) and
verifies up to the chain at batch 1 too (``--speculative-graft-ragged on``); the third drafts nothing
(``--speculative-graft-skip-draft-tokens 0``: every block holds its retrieved chain alone). The rate
guard's probes leave the draft out of one step in eight on every server here (timing pinned where
the counts are asserted, so no rate is judged); the draft-or-not rule is tested on its own, its rates
given (``test_block_graft.py``). A fourth server verifies whole blocks in batches too (``--speculative-graft-ragged off``: the
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

"""SGLang's own ``--speculative-algorithm DFLASH`` (block drafts) served on a CPU through the CPU port
(``sglang_cpu_port.dflash``), float32, greedy: token-exact against the tiny Llama served without
speculation, with a tiny random DFlash draft (``tiny_models.build_dflash_draft``). Its mask positions
propose one token, which the target emits in a run on ``DFLASH_RUN_PROMPT``: whole blocks accepted
there, partial ones at the run's end, none on the other prompts; alone and batched together."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from server_utils import SGLangServer
from tiny_models import DFLASH_BLOCK, DFLASH_RUN_PROMPT

pytestmark = pytest.mark.server

NEW_TOKENS = 32
PROMPTS = [DFLASH_RUN_PROMPT] + [[1, 100 + i, 200 + 3 * i, 300, 17 * i + 5, 42, 7] for i in range(3)]


@pytest.fixture(scope="module")
def reference(plain_llama):
    """Greedy outputs of the tiny Llama without speculation (default CPU backend, float32)."""
    return [plain_llama.generate_ids(p, NEW_TOKENS)["output_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def dflash(tiny_models, server_logs):
    args = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(tiny_models["llama-dflash"]),
            "--max-running-requests", "8"]
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "dflash-llama.log") as srv:
        yield srv


def test_dflash_is_token_exact_and_accepts_blocks(dflash, reference):
    outs = [dflash.generate_ids(p, NEW_TOKENS) for p in PROMPTS]
    assert [o["output_ids"] for o in outs] == reference
    metas = [o["meta_info"] for o in outs]
    # every request was verified block by block: a block drafts DFLASH_BLOCK - 1 tokens per verify
    for meta in metas:
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * (DFLASH_BLOCK - 1)
    run, others = metas[0], metas[1:]
    # the run: whole blocks accepted (the histogram's last bin: DFLASH_BLOCK - 1 correct drafts)
    histogram = run["spec_correct_drafts_histogram"]
    assert len(histogram) == DFLASH_BLOCK and histogram[-1] > 0, run
    assert run["spec_num_correct_drafts"] == sum(i * n for i, n in enumerate(histogram))
    assert run["spec_accept_length"] > 2 and run["spec_verify_ct"] < NEW_TOKENS // 2, run
    assert all(m["spec_num_correct_drafts"] == 0 for m in others)


def test_dflash_batched_is_token_exact(dflash, reference):
    """The prompts in one batch: requests that accept whole blocks beside ones that accept none."""
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: dflash.generate_ids(p, NEW_TOKENS), PROMPTS))
    assert [o["output_ids"] for o in outs] == reference
    assert outs[0]["meta_info"]["spec_num_correct_drafts"] > 0

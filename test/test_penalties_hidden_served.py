"""Exact where SGLang's own speculation is not, on GRAFT servers with a tree (the CPU default) and a
chain in the CUDA configuration (sync-free steps):

* penalties: greedy requests with frequency / presence / repetition penalties, ``min_new_tokens``
  and logit bias get token for token the output of a plain server, alone and mixed in one batch;
* ``return_hidden_states`` (``--enable-return-hidden-states``): the target's final hidden state of
  every prompt and output position, as a plain server returns it (SGLang 0.5.23's EAGLE-3 returns
  its head's ``3 x hidden`` capture).

The reference is a plain server without the overlap scheduler, each request sent alone: SGLang's
overlap scheduler accumulates penalties from a lagging output (docs/sglang-findings.md), so only
the scheduler without it penalises each position from exactly the tokens before it. Penalties that
add and one that scales are not combined in one request: SGLang's scheduler without overlap
applies its penalizers in an order that varies between processes.
"""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest
import requests

from pinned_costs import pinned_env
from server_utils import SGLangServer

pytestmark = pytest.mark.server

NEW_TOKENS = 48
# the tiny random model loops on these, so retrieval proposes and verify accepts chains, and small
# penalties move the loop's later tokens: with SGLang's one-penalty-per-step GRAFT's output differs
# from the plain server's in 5 of these 10 penalised requests
PROMPTS = [
    "x = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\n",
    "ab ab ab ab ab ab ab ab ab ab ab ab",
]
KINDS = {
    "frequency": {"frequency_penalty": 0.2},
    "small-frequency": {"frequency_penalty": 0.05},
    "presence": {"presence_penalty": 0.3},
    "frequency+presence": {"frequency_penalty": 0.1, "presence_penalty": 0.2},
    "repetition": {"repetition_penalty": 1.1},
}


def _ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _requests(ids: list[list[int]], plain_outputs: list[list[int]]) -> list[tuple[str, list[int], dict]]:
    """(name, prompt ids, sampling params): every kind on every prompt, ``min_new_tokens`` with a
    stop token the unpenalised output emits early, logit bias, and requests without penalties."""
    reqs = []
    for p, prompt in enumerate(ids):
        for kind, params in KINDS.items():
            reqs.append((f"{kind}/{p}", prompt, params))
        stop = plain_outputs[p][2]  # would stop the request at its 3rd token
        reqs.append((f"min_new_tokens/{p}", prompt, {"min_new_tokens": 12, "stop_token_ids": [stop],
                                                     "ignore_eos": False}))
        reqs.append((f"logit_bias/{p}", prompt, {"logit_bias": {str(plain_outputs[p][1]): -5.0,
                                                                str(prompt[-1]): 2.0}}))
        reqs.append((f"none/{p}", prompt, {}))
    return reqs


@pytest.fixture(scope="module")
def reference(tiny_models, server_logs):
    """Each request's greedy output from a plain server without the overlap scheduler, sent alone."""
    ids = _ids(tiny_models["llama"])
    with SGLangServer(tiny_models["llama"], ["--disable-overlap-schedule", "--enable-return-hidden-states"],
                      log_path=server_logs / "plain-llama-no-overlap.log") as srv:
        plain = [srv.generate_ids(p, NEW_TOKENS)["output_ids"] for p in ids]
        reqs = _requests(ids, plain)
        outputs = {name: srv.generate_ids(prompt, NEW_TOKENS, **params)["output_ids"] for name, prompt, params in reqs}
        hidden = [_hidden(srv, p) for p in ids]
    return reqs, plain, outputs, hidden


def _hidden(srv, prompt: list[int]) -> tuple[list[int], np.ndarray, int]:
    """(output ids, hidden states ``[positions, hidden]``, verify steps) of a greedy request, its
    whole prompt computed (a cached prefix returns no rows: the cache is flushed first)."""
    requests.post(srv.url + "/flush_cache", timeout=60).raise_for_status()
    r = requests.post(srv.url + "/generate", timeout=300, json={
        "input_ids": prompt, "return_hidden_states": True,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
    r.raise_for_status()
    out = r.json()
    rows = [np.asarray(h, dtype=np.float64).reshape(-1, np.asarray(h).shape[-1]) for h in out["meta_info"]["hidden_states"]]
    return out["output_ids"], np.concatenate(rows), out["meta_info"].get("spec_verify_ct", 0)


@pytest.mark.parametrize("mode,extra", [
    ("tree", []),
    ("chain-sync-free", ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "12",
                         "--speculative-graft-thresholds", "0", "0.5", "0.5", "--speculative-graft-sync-free", "on"]),
])
def test_penalised_greedy_output_equals_a_plain_servers(tiny_models, server_logs, reference, mode, extra, tmp_path):
    """Step costs pinned (the acceptance asserted depends on the cost-aware step's choices)."""
    reqs, plain, want, _ = reference
    # the penalties matter here: each kind changes the unpenalised output of some prompt
    for kind in [*KINDS, "min_new_tokens", "logit_bias"]:
        assert any(want[f"{kind}/{p}"] != plain[p] for p in range(len(PROMPTS))), kind
    args = ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8",
            "--max-running-requests", "32", "--enable-return-hidden-states", *extra]
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / f"graft-penalties-{mode}.log",
                      env=pinned_env(tmp_path / "pinned")) as srv:
        alone = {name: srv.generate_ids(prompt, NEW_TOKENS, **params) for name, prompt, params in reqs}
        with cf.ThreadPoolExecutor(len(reqs)) as pool:
            futures = {name: pool.submit(srv.generate_ids, prompt, NEW_TOKENS, **params)
                       for name, prompt, params in reqs}
            batched = {name: f.result() for name, f in futures.items()}
        hidden = [_hidden(srv, p) for p in _ids(tiny_models["llama"])]
        info = requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]
    for name, out in [*alone.items(), *batched.items()]:
        assert out["output_ids"] == want[name], name
    # speculation was on: penalised requests accepted proposals (tokens beyond one per verify step)
    accepted = {name: len(out["output_ids"]) - 1 - out["meta_info"]["spec_verify_ct"] for name, out in alone.items()}
    assert sum(v for name, v in accepted.items() if not name.startswith("none/")) >= 10, accepted
    assert info["graft"]["penalised_steps"] > 0
    # hidden states: the plain server's, row for row (accepted drafts among them)
    for (ids, rows, _), (want_ids, want_rows, _) in zip(hidden, reference[3]):
        assert ids == want_ids
        assert rows.shape == want_rows.shape, (rows.shape, want_rows.shape)
        np.testing.assert_allclose(rows, want_rows, rtol=1e-4, atol=1e-4)
    assert sum(len(ids) - 1 - steps for ids, _, steps in hidden) > 0

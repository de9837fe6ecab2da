"""A GRAFT server under mixed load and bad input (tiny Llama + tiny EAGLE-3 head, float32), with the
CPU default and with the sync-free step (1-3).

1. Every bad input alone: a 4xx with a clear message, and the server still healthy after each.
2. ~100 mixed requests, up to 32 in flight, twice: greedy (1 / 2 / 17 / 64 tokens, stop strings,
   stop token ids, natural EOS, logprobs, streaming, regex and JSON-schema decoding), sampling
   (top-p / top-k / min-p, n = 2), penalties, streams dropped mid-way, aborts, and the bad inputs
   again. Greedy outputs are token-identical to a server without speculation; afterwards the
   server is healthy and its free KV, live stores and admitted requests are back to idle; the
   second round's greedy outputs equal the first's.
3. The distribution of the first token GRAFT's tree verify samples, and no speculation's, fit
   the exact target distribution (chi-square goodness of fit, 4,000 independent samples).
4. Under ``--speculative-graft-recycle-scope request`` a request's per-step acceptance does not
   depend on what another request taught the recycling matrix.

Penalty requests are served but not compared: SGLang applies penalties to speculative trees in a
relaxed way (one token per step), and without speculation its overlap scheduler accumulates them
per step, not per token (see the README).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import random
import time

import pytest
import requests

from pinned_costs import pinned_env
from server_utils import SGLangServer

pytestmark = pytest.mark.server

VOCAB = 4096
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "import os\nimport os\nimport os\nimport",
    "The quick brown fox",
    "class Config:\n    def __init__(self",
    "for i in range(10):\n    print(i)\n",
    "Once upon a time",
    "x = 1\nx = 1\nx = 1\nx = 1\n",
    "SELECT name FROM users WHERE",
]
BAD_INPUTS = [
    ({"text": ""}, "empty"),
    ({"input_ids": [2 ** 20]}, "out-of-vocabulary"),
    ({"input_ids": [VOCAB]}, "out-of-vocabulary"),
    ({"input_ids": [5, -1]}, "out-of-vocabulary"),
    ({"input_ids": []}, "empty"),
    ({"text": ["", "hello"]}, "empty"),
]
JSON_SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                          "age": {"type": "integer"}}, "required": ["name", "age"]})
GRAFT_ARGS = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8",
              "--max-running-requests", "32", "--enable-metrics"]


def _graft(tiny_models, *extra):
    return ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
            *GRAFT_ARGS, *extra]


@pytest.fixture(scope="module")
def plain_server(plain_llama):
    return plain_llama


@pytest.fixture(scope="module", params=["off", "on"], ids=["fresh", "sync-free"])
def graft_server(tiny_models, server_logs, request):
    """The CPU default, and the sync-free step (CUDA's default: lagged commits, a request's paths
    forgotten when it is aborted or retracted)."""
    args = _graft(tiny_models, "--speculative-graft-recycle-scope", "shared", "--speculative-graft-sync-free",
                  request.param)
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / f"reliability-graft-{request.param}.log") as srv:
        yield srv


def _post(srv, body, path="/generate", timeout=300):
    return requests.post(srv.url + path, json=body, timeout=timeout)


def _healthy(srv) -> bool:
    return requests.get(srv.url + "/health", timeout=30).status_code == 200


def _graft_state(srv) -> dict:
    return requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]["graft"]


def _wait_idle(srv, idle: dict, timeout: float = 60.0) -> dict:
    deadline = time.time() + timeout
    while True:
        state = _graft_state(srv)
        keys = ("kv_free_tokens", "live_stores", "admitted_requests", "store_bytes")
        if all(state[k] == idle[k] for k in keys) or time.time() > deadline:
            return state
        time.sleep(0.5)


# -- the request mix ----------------------------------------------------------------------------
def _greedy_requests() -> list[dict]:
    """Deterministic requests whose output must equal no speculation's."""
    reqs = []
    for i, prompt in enumerate(PROMPTS):
        for n in (1, 2, 17, 64):
            reqs.append({"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
        sp = {"max_new_tokens": 40, "temperature": 0}
        reqs.append({"text": prompt, "sampling_params": {**sp, "stop": ["\n", " the"]}})
        reqs.append({"text": prompt, "sampling_params": {**sp, "stop_token_ids": [10, 11, 12, 13, 14, 15]}})
        reqs.append({"text": prompt, "sampling_params": sp})  # natural EOS allowed
        reqs.append({"text": prompt, "return_logprob": True, "top_logprobs_num": 2,
                     "sampling_params": {**sp, "max_new_tokens": 12, "ignore_eos": True}})
    for prompt in PROMPTS[:3]:
        reqs.append({"text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                         "regex": "(yes|no|maybe)( [a-z]{1,6}){2,4}"}})
        reqs.append({"text": prompt, "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                                         "json_schema": JSON_SCHEMA}})
        reqs.append({"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 20, "temperature": 0,
                                                                       "ignore_eos": True}})
    return reqs


def _other_requests(rng: random.Random) -> list[dict]:
    """Requests that must complete but are not compared token by token."""
    reqs = []
    for i, prompt in enumerate(PROMPTS):
        reqs.append({"text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0.8, "top_p": 0.9,
                                                         "sampling_seed": i, "ignore_eos": True}})
        reqs.append({"text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "top_k": 5,
                                                         "sampling_seed": i, "ignore_eos": True}})
        reqs.append({"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0.7, "min_p": 0.05,
                                                         "ignore_eos": True}})
        pen = [{"frequency_penalty": 0.8}, {"presence_penalty": 0.6}, {"repetition_penalty": 1.3}][i % 3]
        reqs.append({"text": prompt, "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True,
                                                         **pen}})
    for prompt in PROMPTS[:2]:
        reqs.append({"text": prompt, "sampling_params": {"n": 2, "max_new_tokens": 12, "temperature": 0.9,
                                                         "ignore_eos": True}})
    rng.shuffle(reqs)
    return reqs


def _send(srv, body: dict) -> dict:
    """Send one request; returns {"status", "output_ids" (greedy), ...}."""
    if body.get("stream"):
        ids = []
        with requests.post(srv.url + "/generate", json=body, stream=True, timeout=300) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line and line.startswith("data: ") and line != "data: [DONE]":
                    ids = json.loads(line[len("data: "):])["output_ids"]
            return {"status": r.status_code, "output_ids": ids}
    r = _post(srv, body)
    out = {"status": r.status_code}
    if r.ok:
        data = r.json()
        data = data if isinstance(data, list) else [data]
        out["output_ids"] = [d["output_ids"] for d in data] if len(data) > 1 else data[0]["output_ids"]
        out["finish"] = data[0]["meta_info"]["finish_reason"]
    else:
        out["error"] = r.text
    return out


def _drop_stream(srv, prompt: str) -> str:
    with requests.post(srv.url + "/generate", json={"text": prompt, "stream": True, "sampling_params": {
            "max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}, stream=True, timeout=300) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break  # the client goes away mid-stream
    return "dropped"


def _abort(srv, prompt: str, rid: str) -> str:
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_post, srv, {"rid": rid, "text": prompt, "sampling_params": {
            "max_new_tokens": 400, "temperature": 0, "ignore_eos": True}})
        time.sleep(0.3)
        requests.post(srv.url + "/abort_request", json={"rid": rid}, timeout=30)
        r = fut.result()
    return r.json()["meta_info"]["finish_reason"]["type"] if r.ok else f"http {r.status_code}"


def _round(srv, greedy, other, tag: str) -> tuple[list, list, list, list]:
    jobs = [("greedy", i, b) for i, b in enumerate(greedy)] + [("other", i, b) for i, b in enumerate(other)]
    jobs += [("bad", i, b) for i, (b, _) in enumerate(BAD_INPUTS)]
    jobs += [("drop", i, PROMPTS[i]) for i in range(3)] + [("abort", i, PROMPTS[i]) for i in range(3)]
    random.Random(tag).shuffle(jobs)
    results = {}
    with cf.ThreadPoolExecutor(32) as pool:
        futs = {}
        for kind, i, body in jobs:
            if kind == "drop":
                futs[pool.submit(_drop_stream, srv, body)] = (kind, i)
            elif kind == "abort":
                futs[pool.submit(_abort, srv, body, f"{tag}-abort-{i}")] = (kind, i)
            elif kind == "bad":
                futs[pool.submit(_post, srv, {**body, "sampling_params": {"max_new_tokens": 4}})] = (kind, i)
            else:
                futs[pool.submit(_send, srv, body)] = (kind, i)
        for fut in cf.as_completed(futs):
            results[futs[fut]] = fut.result()
    by = lambda kind, n: [results[(kind, i)] for i in range(n)]  # noqa: E731
    return by("greedy", len(greedy)), by("other", len(other)), by("bad", len(BAD_INPUTS)), by("abort", 3)


def test_bad_inputs_alone_then_mixed_load_twice(graft_server, plain_server):
    srv = graft_server
    # 1. each bad input alone
    for body, words in BAD_INPUTS:
        r = _post(srv, {**body, "sampling_params": {"max_new_tokens": 4}})
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert words in r.text.lower(), r.text
        assert _healthy(srv), body
    idle = _graft_state(srv)
    assert idle["live_stores"] == 0 and idle["admitted_requests"] == 0

    # 2. the mixed load, twice
    greedy = _greedy_requests()
    other = _other_requests(random.Random(0))
    reference = [_send(plain_server, b) for b in greedy]
    assert all(r["status"] == 200 for r in reference)
    rounds = []
    for tag in ("round1", "round2"):
        g, o, bad, aborted = _round(srv, greedy, other, tag)
        assert all(r["status"] == 200 for r in g + o), [r for r in g + o if r["status"] != 200][:3]
        assert all(400 <= r.status_code < 500 for r in bad), [(r.status_code, r.text) for r in bad]
        assert all(a in ("abort", "length") for a in aborted), aborted
        mismatched = [(greedy[i], g[i]["output_ids"], reference[i]["output_ids"]) for i in range(len(greedy))
                      if g[i]["output_ids"] != reference[i]["output_ids"]]
        assert not mismatched, (len(mismatched), mismatched[:2])
        for body, r in zip(other, o):
            n = body["sampling_params"].get("n", 1)
            outs = r["output_ids"] if n > 1 else [r["output_ids"]]
            assert len(outs) == n and all(0 <= t < VOCAB for out in outs for t in out)
        assert _healthy(srv)
        after = _wait_idle(srv, idle)
        for key in ("kv_free_tokens", "live_stores", "admitted_requests", "store_bytes"):
            assert after[key] == idle[key], (tag, key, after, idle)
        rounds.append([r["output_ids"] for r in g])
    assert rounds[0] == rounds[1]
    assert "Traceback" not in srv.tail(10 ** 8)  # a start, bad input and aborts log no traceback
    state = _graft_state(srv)
    assert state["verify_steps"] > 0 and state["sampling_verify_steps"] > 0
    print(f"\nreliability: {len(greedy) + len(other) + len(BAD_INPUTS) + 6} requests per round, "
          f"{len(greedy)} greedy token-exact, {len(BAD_INPUTS)} bad inputs -> 4xx, aborts {aborted}")


SAMPLED_PROMPT = list(range(100, 140)) * 2  # repetitive: retrieval proposes, drafts get accepted
SAMPLING = dict(temperature=0.9, top_k=4)
NUM_SAMPLES = 4000


def _first_two_tokens(srv, n: int) -> list[tuple[int, int]]:
    """``n`` independent samples of a request's first two tokens (SGLang ignores
    ``sampling_seed`` without ``--enable-deterministic-inference``, so none is sent)."""
    def one(_):
        r = _post(srv, {"input_ids": SAMPLED_PROMPT,
                        "sampling_params": {"max_new_tokens": 2, "ignore_eos": True, **SAMPLING}})
        r.raise_for_status()
        return tuple(r.json()["output_ids"])

    with cf.ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(n)))


@pytest.fixture(scope="module")
def exact_pairs(tiny_models) -> dict:
    """The exact joint distribution of the first two tokens: ``{(t1, t2): prob}`` from the target's
    float32 logits (transformers), temperature and top-k applied in float64."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()

    def next_token(ids) -> dict:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double() / SAMPLING["temperature"]
        probs, tokens = logits.softmax(-1).topk(SAMPLING["top_k"])
        return dict(zip(tokens.tolist(), (probs / probs.sum()).tolist()))

    return {(a, b): pa * pb for a, pa in next_token(SAMPLED_PROMPT).items()
            for b, pb in next_token(SAMPLED_PROMPT + [a]).items()}


@pytest.fixture(scope="module")
def plain_pairs(plain_server) -> list:
    return _first_two_tokens(plain_server, NUM_SAMPLES)


def _fit_p_value(samples: list, exact: dict) -> float:
    """Chi-square goodness-of-fit p-value of ``samples`` against ``exact`` (outcomes expected
    fewer than 10 times pooled into one cell). An outcome ``exact`` gives no mass fails at once."""
    from scipy.stats import chisquare

    outside = [s for s in samples if s not in exact]
    assert not outside, f"tokens outside the target's top-k: {outside[:5]}"
    n = len(samples)
    big = [o for o in exact if exact[o] * n >= 10]
    observed = [samples.count(o) for o in big]
    expected = [exact[o] * n for o in big]
    if len(big) < len(exact):
        observed.append(n - sum(observed))
        expected.append(n - sum(expected))
    return chisquare(observed, expected).pvalue


def test_sampled_token_distribution_matches_no_speculation(graft_server, plain_pairs, exact_pairs):
    """Token 2 is the first one GRAFT's tree verify samples (token 1 comes from the prefill). The
    joint of both, from GRAFT and from no speculation, fits the exact target distribution:
    4,000 samples and a 1e-4 threshold, so a chance failure comes once in ~3,000 runs, and a
    shift of 3 % of the mass between the two likeliest outcomes is caught 97 % of the time."""
    graft = _first_two_tokens(graft_server, NUM_SAMPLES)
    assert len({p[1] for p in graft}) >= 3  # a real distribution, not a constant
    assert _fit_p_value(plain_pairs, exact_pairs) > 1e-4  # the reference is no speculation's
    p_value = _fit_p_value(graft, exact_pairs)
    assert p_value > 1e-4, (p_value, sorted(collections.Counter(graft).items()), exact_pairs)


def test_isolated_recycling_scope_keeps_requests_independent(tiny_models, server_logs, tmp_path):
    """B, then A (other content), then B again: with per-request scopes B's per-step acceptance
    is identical; with one shared matrix B's second run profits from what the first taught it.
    (Fixed budget: the cost-aware budget also follows its acceptance calibration, statistics over all
    requests; step costs pinned besides, so nothing here reads the machine's load.)"""
    b_prompt = "for i in range(10):\n    for j in range(10):\n        for k in range(10):\n"
    a_prompt = "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2;"

    def steps(srv, prompt):
        r = _post(srv, {"text": prompt, "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                                            "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["meta_info"]["graft_steps"]

    results = {}
    for scope in ("request", "shared"):
        args = _graft(tiny_models, "--speculative-graft-source", "recycle", "--speculative-graft-recycle-scope", scope,
                      "--speculative-graft-per-step-metrics", "--speculative-graft-budget-mode", "fixed")
        with SGLangServer(tiny_models["llama"], args, log_path=server_logs / f"reliability-scope-{scope}.log",
                          env=pinned_env(tmp_path / scope)) as srv:
            first = steps(srv, b_prompt)
            steps(srv, a_prompt)
            results[scope] = (first, steps(srv, b_prompt))
    first, second = results["request"]
    assert first == second
    first, second = results["shared"]
    assert sum(second["retrieved_accepted"]) > sum(first["retrieved_accepted"])

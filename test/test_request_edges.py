"""Request edges on a GRAFT server and on a server without speculation (tiny Llama + tiny EAGLE-3
head, float32), one of each for the whole module (``graft_server``, ``plain_server``).

1. Logprob counts outside their range (``top_logprobs_num`` above the vocabulary size or
   negative, also on the OpenAI routes and for one request of a batch; ``logprob_start_len``
   below -1) get a 400 naming the field, and both servers stay healthy. Unpatched, a count above
   the vocabulary (even that of a batch's request that asks no logprobs) and a start below -1 take
   the scheduler, and so the server, down (``RuntimeError: selected index k out of range``, an
   ``AssertionError`` on the input logprobs); a negative count was accepted.
2. Multi-turn traffic with stop strings: five conversations of three turns, each turn's prompt the
   previous prompt, the previous answer and new user text. Greedy outputs are token-identical to
   no speculation's; the prefix-cache hits per turn are no speculation's, or one token fewer
   where SGLang's EAGLE-family radix key says so (the exact rule in
   :func:`test_multi_turn_prefix_cache_reuse_matches_no_speculation`); and no token GRAFT committed
   past a stop string reaches the radix tree.
3. The end of the context: every request a plain server answers, GRAFT answers the same (HTTP code,
   token-identical greedy output, finish reason), alone and batched: prompts up to the longest SGLang
   admits, with and without ``max_new_tokens``, generations that run into the context's end. Before
   the fix, such requests killed the scheduler (each speculative step reserves
   ``2 * max(steps * topk, N)`` KV slots past the committed length, more than a request's
   ``req_to_token`` row holds past the context: an ``IndexError`` in the CPU ``assign_req_to_token_pool``)
   and prompts a plain server serves got a 400 (SGLang takes ``max(steps * topk, N)`` tokens off an
   EAGLE request's context). Checked on ``graft_server`` and on GRAFT's default shape (steps 6, topk 4,
   N 16: the largest reserve) with the fixed budget (16 nodes every step) and the sync-free step.
4. A full KV pool: under GRAFT's KV reserve of one step's window per request (no overlap scheduler),
   a load the pool cannot hold is retracted and re-admitted, token-identical to no speculation, and
   every slot is free afterwards.
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import pytest
import requests

from server_utils import SGLangServer
from request_edges import EDGE_CASES, EDGE_CODES, edge_body  # noqa: E402 (benchmark/, on the path)

VOCAB = 4096
# Plain steps off: every decode step verifies a tree, so the edges below meet the speculative commit
# (the tiny random head rarely pays for a tree, and the cost-aware step would verify most roots alone;
# a plain step's commit is SGLang's one-node verify, the N = 1 step these tests served before)
GRAFT_ARGS = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8",
              "--max-running-requests", "32", "--speculative-graft-plain-steps", "off"]


@pytest.fixture(scope="module")
def plain_server(plain_llama):
    return plain_llama


@pytest.fixture(scope="module")
def graft_server(tiny_models, server_logs):
    args = ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
            *GRAFT_ARGS]
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "request-edges-graft.log") as srv:
        yield srv


def _post(srv, body, path="/generate", timeout=300):
    return requests.post(srv.url + path, json=body, timeout=timeout)


def _healthy(srv) -> bool:
    try:
        return requests.get(srv.url + "/health", timeout=30).status_code == 200
    except requests.ConnectionError:
        return False


def _tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["llama"])


# -- 1. logprob bounds ---------------------------------------------------------------------------
def _check_logprobs(**fields):
    from types import SimpleNamespace

    from sglang_graft.sglang import hooks

    hooks.check_logprob_request(SimpleNamespace(**fields), VOCAB)


@pytest.mark.parametrize("fields", [
    {}, {"top_logprobs_num": 0}, {"top_logprobs_num": VOCAB}, {"top_logprobs_num": [0, 5, VOCAB]},
    {"return_logprob": True, "top_logprobs_num": 20, "logprob_start_len": -1},
    {"return_logprob": True, "logprob_start_len": 0}, {"return_logprob": True, "logprob_start_len": 10 ** 6},
    {"return_logprob": [False, True], "logprob_start_len": [-1, 3]},
    {"return_logprob": False, "logprob_start_len": -5},  # ignored without logprobs (SGLang resets it)
])
def test_logprob_fields_in_range_pass(fields):
    _check_logprobs(**fields)


@pytest.mark.parametrize("fields,field", [
    ({"top_logprobs_num": VOCAB + 1}, "top_logprobs_num"),
    ({"top_logprobs_num": 10 ** 6, "return_logprob": True}, "top_logprobs_num"),
    ({"top_logprobs_num": -1, "return_logprob": True}, "top_logprobs_num"),
    ({"top_logprobs_num": 2.5}, "top_logprobs_num"),
    ({"top_logprobs_num": "3"}, "top_logprobs_num"),
    ({"top_logprobs_num": True}, "top_logprobs_num"),
    ({"top_logprobs_num": [2, VOCAB + 1], "return_logprob": [True, False]}, "top_logprobs_num"),
    ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"return_logprob": True, "logprob_start_len": 1.5}, "logprob_start_len"),
    ({"return_logprob": [False, True], "logprob_start_len": [-1, -7]}, "logprob_start_len"),
])
def test_logprob_fields_out_of_range_are_rejected(fields, field):
    with pytest.raises(ValueError) as err:
        _check_logprobs(**fields)
    message = str(err.value)
    assert message.startswith(field + " must be") and "\n" not in message


BAD_LOGPROBS = [  # (path, body, field named in the 400)
    ("/generate", {"return_logprob": True, "top_logprobs_num": VOCAB + 1}, "top_logprobs_num"),
    ("/generate", {"return_logprob": True, "top_logprobs_num": 10 ** 6}, "top_logprobs_num"),
    ("/generate", {"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    # no logprobs asked here, yet SGLang takes this request's count for the batch's top-k
    ("/generate", {"text": ["The quick brown fox", "Once upon a time"], "return_logprob": [True, False],
                   "top_logprobs_num": [2, VOCAB + 1]}, "top_logprobs_num"),
    ("/generate", {"return_logprob": True, "logprob_start_len": -5}, "logprob_start_len"),
    # already rejected by SGLang itself (kept here so that stays true)
    ("/generate", {"return_logprob": True, "logprob_start_len": 10 ** 6}, "logprob_start_len"),
    ("/generate", {"return_logprob": True, "token_ids_logprob": [VOCAB]}, "token_ids_logprob"),
    ("/generate", {"return_logprob": True, "token_ids_logprob": [-1]}, "token_ids_logprob"),
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 2, "logprobs": VOCAB + 1}, "top_logprobs_num"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
                              "top_logprobs": 10 ** 6}, "top_logprobs_num"),
]


def _body(srv, path, fields):
    if path == "/generate":
        return {"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 2, "temperature": 0}, **fields}
    model = requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return {"model": model, "temperature": 0, **fields}


@pytest.mark.server
@pytest.mark.parametrize("server", ["graft_server", "plain_server"])
def test_logprob_counts_outside_the_vocabulary_get_a_400(server, request):
    """Each out-of-range logprob field alone: a 400 that names it, the server healthy after it; the
    boundary (``top_logprobs_num`` = the vocabulary size) still served."""
    srv = request.getfixturevalue(server)
    for path, fields, field in BAD_LOGPROBS:
        try:
            r = _post(srv, _body(srv, path, fields), path=path, timeout=120)
        except requests.ConnectionError as e:
            pytest.fail(f"{path} {fields}: the server went down ({e}): {srv.tail()}")
        assert r.status_code == 400, (path, fields, r.status_code, r.text[:300])
        assert field in r.text, (path, fields, r.text[:300])
        assert _healthy(srv), (path, fields, srv.tail())
    r = _post(srv, _body(srv, "/generate", {"return_logprob": True, "top_logprobs_num": VOCAB}))
    assert r.status_code == 200, r.text[:300]
    top = r.json()["meta_info"]["output_top_logprobs"]
    assert len(top) == 2 and all(len(row) == VOCAB for row in top)
    good = _post(srv, _body(srv, "/generate", {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}))
    assert good.status_code == 200 and all(len(row) == 3 for row in good.json()["meta_info"]["output_top_logprobs"])


# -- 2. multi-turn traffic and the prefix cache --------------------------------------------------
MAX_NEW = 40
CONVERSATIONS = [  # (user texts, stop strings)
    # Each stop string is in the tiny model's greedy output. In the first four conversations it
    # ends the first answer at the first token of a run one verify step accepts (on a fresh tenant:
    # tokens 34-37, 13-15, 23-25, 7-9 of the answer), so that step commits past the stop.
    (["x = 1\n" * 8, "\nx = 1\nx = 1\nx = 1\n", "\ny = 2\ny = 2\n"], [" divmod iterator iterator"]),
    (["ab" + " ab" * 17, " ab ab ab ab", " cd cd cd cd"], ["ABC what what"]),
    (["import os\n" * 5 + "import", "\nimport os\nimport", "\nimport sys\nimport sys\n"], ["sistentstrict"]),
    (["a" + " a" * 23, " a a a a", " b b b b"], ["Emax attr"]),
    (["Repeat this passage exactly: the cat sat on the mat. Repeat: the cat sat on the mat. Repeat:",
      " the cat sat on the mat. Repeat:", " Again: the cat"], ["info text"]),  # stops the first two turns
]


def _answer_ids(tok, output_ids: list[int], text: str) -> list[int]:
    """The answer's tokens as a chat client keeps them: the returned tokens whose text is the
    returned text (SGLang returns the stop string's tokens but not its text)."""
    k = len(output_ids)
    while k and not text.startswith(tok.decode(output_ids[:k])):
        k -= 1
    return output_ids[:k]


def _flush(srv) -> None:
    r = requests.post(srv.url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text


def _salt(conv: int) -> str:
    """One ``cache_salt`` per conversation: GRAFT's recycling matrix (one per tenant by default)
    starts empty for it, whatever else the module served, so the runs its first turn accepts (and
    so the tokens committed past its stop) are those the stop strings were placed for."""
    return f"multi-turn-{conv}"


def _converse(srv, tok) -> list[dict]:
    """Every conversation, turn after turn: prompt = previous prompt + previous answer + user text."""
    turns = []
    for c, (texts, stop) in enumerate(CONVERSATIONS):
        ids: list[int] = []
        for t, user in enumerate(texts):
            ids = ids + tok(user, add_special_tokens=False)["input_ids"]
            r = _post(srv, {"input_ids": ids, "cache_salt": _salt(c),
                            "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "stop": stop}})
            assert r.status_code == 200, r.text[:300]
            out = r.json()
            m = out["meta_info"]
            assert m["prompt_tokens"] == len(ids)
            # tokens the step loop committed: the prefill's token, then per verify step the accepted
            # nodes and one more (SGLang cuts output_ids at a stop; the commits are not)
            committed = 1 + m.get("graft_draft_accepted", 0) + m.get("graft_retrieved_accepted", 0) + \
                m.get("spec_verify_ct", 0)
            turns.append({"conv": c, "turn": t, "prompt": list(ids), "output_ids": out["output_ids"],
                          "text": out["text"], "finish": m["finish_reason"], "cached": m["cached_tokens"],
                          "committed": committed})
            ids = ids + _answer_ids(tok, out["output_ids"], out["text"])
    return turns


def _stopped(turn) -> bool:
    return turn["finish"]["type"] == "stop" and isinstance(turn["finish"].get("matched"), str)


def _hit_rate(turns) -> float:
    return sum(t["cached"] for t in turns) / sum(len(t["prompt"]) for t in turns)


@pytest.mark.server
def test_multi_turn_prefix_cache_reuse_matches_no_speculation(graft_server, plain_server, tiny_models):
    """Five conversations of three turns with stop strings, on each server from an empty cache.

    1. Greedy outputs (tokens, text, finish reasons) are no speculation's.
    2. Prefix-cache hits (``cached_tokens``) per turn are no speculation's, less one token, except
       after a turn cut at ``max_new_tokens`` whose last verify step ran past the cut: then equal.
       Both come from SGLang's EAGLE path, not from GRAFT's step: the radix tree keys an EAGLE-family
       server's KV by token pairs (``is_bigram``; the draft's KV at a position is computed from the
       next token too), so a match of n tokens reuses n - 1; and it keys a finished request up to
       the tokens whose KV is computed: without speculation the prompt and the output up to a stop
       (the overlap scheduler's next step computes the stop token's KV) or the output but its last
       token at ``max_new_tokens``; under GRAFT the prompt and output up to the stop or the cut
       where the last verify step committed past it, else all but the last token (the step's bonus
       token, whose KV the next step would compute). After a stop the next prompt leaves the cached
       sequence at the stop (the pair key costs one token); after a cut it runs through it (the key
       covering one token more gives it back).
    3. Nothing committed past a stop string reaches the radix tree. For each turn that stopped on a
       stop string, the tokens greedy decoding produces past the stop (the same request without the
       stop string, under another ``cache_salt``) are appended to the turn's prompt and output and
       sent as a probe. Its ``cached_tokens`` on GRAFT is the prompt and output up to the stop less
       one token (the pair key) where the verify step ran past the stop, less two where the stop was
       the step's bonus token, never more than no speculation's; a token past the stop in the tree
       would make it at least the prompt and output. At least one such turn's verify step accepted
       draft tokens past its stop (committed past the stop, the step's bonus token aside: tokens
       whose KV is computed, the ones that could be keyed).
    """
    tok = _tokenizer(tiny_models)
    runs = {}
    for name, srv in (("plain", plain_server), ("graft", graft_server)):
        _flush(srv)
        runs[name] = _converse(srv, tok)
    plain, graft = runs["plain"], runs["graft"]

    # 1. token-identical greedy outputs, and the stop strings do stop some turns mid-generation
    for p, g in zip(plain, graft):
        where = (g["conv"], g["turn"])
        assert g["output_ids"] == p["output_ids"] and g["text"] == p["text"], where
        assert g["finish"] == p["finish"], where
    stopped = [g for g in graft if _stopped(g)]
    assert len(stopped) >= 4 and {g["conv"] for g in stopped} == set(range(len(CONVERSATIONS)))
    assert all(len(g["output_ids"]) < MAX_NEW for g in stopped)
    assert any(t["turn"] > 0 for t in stopped)

    # 2. the prefix-cache hits
    plain_hits = [p["cached"] for p in plain]
    graft_hits = [g["cached"] for g in graft]
    expected = []
    for i, (p, g) in enumerate(zip(plain, graft)):
        prev = graft[i - 1] if g["turn"] > 0 else None
        through = prev is not None and len(_answer_ids(tok, prev["output_ids"], prev["text"])) == \
            len(prev["output_ids"]) and prev["committed"] > len(prev["output_ids"])
        expected.append(p["cached"] if through else max(p["cached"] - 1, 0))
    assert graft_hits == expected, (plain_hits, graft_hits, [(g["finish"]["type"], g["committed"]) for g in graft])
    assert all(g["turn"] > 0 or g["cached"] == 0 for g in graft)
    for i, p in enumerate(plain):  # no speculation reuses the whole history (less its last token)
        prev = plain[i - 1]
        history = len(prev["prompt"]) + len(_answer_ids(tok, prev["output_ids"], prev["text"]))
        assert p["turn"] == 0 or p["cached"] >= history - 1, (p["conv"], p["turn"], plain_hits)
    later = [p for p in plain if p["turn"] > 0]
    print(f"\nprefix-cache hit rate: no speculation {_hit_rate(plain):.4f}, GRAFT {_hit_rate(graft):.4f} "
          f"(turns after the first: {_hit_rate(later):.4f}, "
          f"{_hit_rate([g for g in graft if g['turn'] > 0]):.4f}); per turn {plain_hits} / {graft_hits}")

    # 3. nothing past a stop in the radix tree
    past_stop = 0
    for g in stopped:
        n_prompt, n_out = len(g["prompt"]), len(g["output_ids"])
        cont = _post(graft_server, {"input_ids": g["prompt"], "cache_salt": "continuation",
                                    "sampling_params": {"max_new_tokens": n_out + 8, "temperature": 0,
                                                        "ignore_eos": True}}).json()["output_ids"]
        assert cont[:n_out] == g["output_ids"], (g["conv"], g["turn"])
        probe = g["prompt"] + cont
        hits = {}
        for name, srv in (("plain", plain_server), ("graft", graft_server)):
            r = _post(srv, {"input_ids": probe, "cache_salt": _salt(g["conv"]),
                            "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
            assert r.status_code == 200, r.text[:300]
            hits[name] = r.json()["meta_info"]["cached_tokens"]
        where = (g["conv"], g["turn"], n_prompt, n_out, g["committed"], hits)
        assert hits["graft"] <= n_prompt + n_out - 1, where  # nothing past the stop
        assert hits["graft"] <= hits["plain"], where
        assert hits["graft"] == n_prompt + n_out - (1 if g["committed"] > n_out else 2), where
        past_stop += g["committed"] - 1 > n_out
    assert past_stop >= 1, [(g["conv"], g["turn"], g["committed"], len(g["output_ids"])) for g in stopped]


# -- 3. the end of the context -------------------------------------------------------------------
def _edge_ask(srv, n: int, max_new) -> tuple:
    r = _post(srv, edge_body(n, max_new))
    if r.status_code != 200:
        return r.status_code, None, None
    body = r.json()
    return 200, body["output_ids"], body["meta_info"]["finish_reason"]


def _edge_answers(srv) -> tuple[list, list]:
    """Every case's answer, first one at a time, then all at once."""
    alone = [_edge_ask(srv, n, m) for n, m in EDGE_CASES]
    with cf.ThreadPoolExecutor(len(EDGE_CASES)) as pool:
        together = list(pool.map(lambda case: _edge_ask(srv, *case), EDGE_CASES))
    assert _healthy(srv)
    return alone, together


@pytest.fixture(scope="module")
def plain_edge_answers(plain_server):
    alone, together = _edge_answers(plain_server)
    assert alone == together, "the plain server's greedy answers changed with batching"
    assert [code for code, _, _ in alone] == EDGE_CODES
    assert sum(1 for _, _, reason in alone if reason and reason["type"] == "length") >= 5
    return alone


def _check_edge(name, plain, alone, together) -> None:
    for case, ref, got_alone, got_together in zip(EDGE_CASES, plain, alone, together):
        assert got_alone == ref, f"{name}, prompt {case[0]} + max_new_tokens {case[1]}: {got_alone[0]} vs {ref[0]}"
        assert got_together == ref, f"{name}, batched, prompt {case[0]} + max_new_tokens {case[1]}"


@pytest.mark.server
def test_context_edge_answers_match_no_speculation(graft_server, plain_edge_answers):
    _check_edge("graft", plain_edge_answers, *_edge_answers(graft_server))


@pytest.mark.server
def test_context_edge_with_the_default_shape_fixed_budget_and_sync_free(tiny_models, server_logs, plain_edge_answers):
    args = ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
            "--max-running-requests", "16", "--speculative-graft-budget-mode", "fixed", "--speculative-graft-sync-free", "on"]
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "request-edges-context.log") as srv:
        _check_edge("graft defaults, fixed, sync-free", plain_edge_answers, *_edge_answers(srv))


@pytest.mark.server
def test_context_edge_through_the_draft_extend_graph_path(tiny_models, server_logs, plain_edge_answers, tmp_path):
    """SGLang's draft-extend CUDA graph copies the batch's positions and replays without
    ``ModelRunner.forward``, whose hook clamps every forward's positions to the context. A CPU has
    no such graph: ``draft_extend_graph_standin.py`` takes its path eagerly (the draft model run
    from the prepared batch, no ``ModelRunner.forward``). With 8 nodes every step, a draft extend
    near the end of the context writes 8 positions past the committed length: every one ran below
    the context (2048), and the answers are no speculation's."""
    record = tmp_path / "draft_extend_positions.txt"
    args = ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
            *GRAFT_ARGS, "--speculative-graft-budget-mode", "fixed"]
    launcher = [str(Path(__file__).with_name("draft_extend_graph_standin.py")), str(record)]
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "request-edges-extend-graph.log",
                      launcher=launcher) as srv:
        _check_edge("graft, draft-extend graph path", plain_edge_answers, *_edge_answers(srv))
        replays = _graft_state(srv)["budget_states"]["replays"]["draft_extend"]
    positions = [int(line) for line in record.read_text().split()]
    assert len(positions) == replays["8"] > 100, (len(positions), replays)
    assert max(positions) == 2047, max(positions)  # the context's last position, reached and not passed


# -- 4. a full KV pool ---------------------------------------------------------------------------
# GRAFT's default shape (steps 6, topk 4, N 16) in a pool of 1024 tokens: twelve requests of 80
# prompt tokens and up to 160 new ones need about 2900, so the scheduler admits what the pool holds
# and retracts running requests when it fills (SGLang admits requests that may stop early against
# an estimate of their output; these do not).
KV_POOL_TOKENS = 1024
FULL_POOL_PROMPTS = [[10 + (i * (k + 3)) % 89 for i in range(80)] for k in range(12)]
FULL_POOL_PARAMS = {"temperature": 0, "max_new_tokens": 160}


def _full_pool_answers(srv) -> list:
    def ask(prompt):
        r = _post(srv, {"input_ids": prompt, "sampling_params": FULL_POOL_PARAMS})
        r.raise_for_status()
        return r.json()["output_ids"]

    with cf.ThreadPoolExecutor(len(FULL_POOL_PROMPTS)) as pool:
        return list(pool.map(ask, FULL_POOL_PROMPTS))


def _graft_state(srv) -> dict:
    return requests.get(srv.url + "/server_info", timeout=60).json()["internal_states"][0]["graft"]


@pytest.mark.server
def test_a_full_kv_pool_retracts_and_answers_as_no_speculation(tiny_models, server_logs, plain_server):
    """Without the overlap scheduler (always on a CPU) a GRAFT request holds one decode step's KV
    window past its committed length, ``max(steps * topk, N)`` = 24 slots, not SGLang's
    overlap-safe two (48): the pool admits more requests. Under that reserve, in a pool too small
    for the load, greedy outputs equal no speculation's, the scheduler retracts and re-admits
    requests (its log says so), and every slot is free again afterwards."""
    expected = [plain_server.generate_ids(p, FULL_POOL_PARAMS["max_new_tokens"], ignore_eos=False)["output_ids"]
                for p in FULL_POOL_PROMPTS]
    assert sum(map(len, expected)) + 80 * len(expected) > 2 * KV_POOL_TOKENS, "the load no longer fills the pool"
    log = server_logs / "request-edges-full-pool.log"
    args = ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
            "--max-running-requests", "16", "--max-total-tokens", str(KV_POOL_TOKENS),
            "--speculative-graft-plain-steps", "off"]
    with SGLangServer(tiny_models["llama"], args, log_path=log) as srv:
        idle = _graft_state(srv)
        assert idle["kv_reserve_per_request"] == 24
        got = _full_pool_answers(srv)
        for k, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"request {k}: GRAFT's greedy output differs from no speculation's"
        assert _healthy(srv)
        assert _graft_state(srv)["kv_free_tokens"] == idle["kv_free_tokens"]
    assert "KV cache pool is full. Retract requests." in log.read_text(), "no request was retracted"

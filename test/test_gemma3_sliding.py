"""GRAFT on a Gemma-3 target with sliding-window attention, token-exact on a real SGLang CPU server.

The tiny ``Gemma3ForCausalLM`` (``tiny_models``) attends through a window of 8 tokens on layers 0, 1
and 3 (layer 2 sees everything); every prompt here is 3-5 windows long, and 40 new tokens are 5 more.

* The plain server (no speculation; chunked prefill of 16 tokens, so prefills extend cached chunks
  past the window) gives HF transformers' greedy tokens (float32, eager attention), which the window
  shapes from the first new token on: the CPU port's windowed prefill, extend and decode are right.
* GRAFT gives the plain server's tokens, alone, under concurrency and on a cached prefix, with
  full-depth 4-wide draft trees verified at every step and retrieved chains longer than the window
  accepted, the EAGLE-3 head's own layer windowed too (``--speculative-draft-window-size``); and with
  the cost-aware defaults.
* Tree verify attention with a window, against each branch read as an ordinary sequence, node by
  node. One rule of it barely shows in served tokens: a node deeper than the window must not see the
  top of its own branch, and the chains accepted that deep here are runs of one repeated token, whose
  keys look alike (the served tests pass without that rule; this one does not).
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
import torch

from pinned_costs import pinned_env
from server_utils import SGLangServer
from tiny_models import GEMMA3_SLIDING_WINDOW, hf_greedy

W = GEMMA3_SLIDING_WINDOW
NEW_TOKENS = 40
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "Repeat this passage exactly: the cat sat on the mat. Repeat: the cat sat on the mat. Repeat:",
    "x = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\n",
    "for i in range(10):\n    for i in range(10):\n        for i in range(10):\n            for i in",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The",
    "return self._data[key]\n\n    def __setitem__(self, key, value):\n        self._data[key] = value\n",
]
CACHED = 12  # a second request: prompt + the first CACHED outputs, served from the prefix cache


@pytest.fixture(scope="module")
def prompt_ids(tiny_models) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["gemma3"])
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    assert min(map(len, ids)) > 3 * W
    return ids


@pytest.fixture(scope="module")
def plain_gemma3(tiny_models, server_logs):
    with SGLangServer(tiny_models["gemma3"], ["--chunked-prefill-size", "16"],
                      log_path=server_logs / "gemma3-plain.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(plain_gemma3, prompt_ids) -> list[list[int]]:
    """Greedy outputs of the plain server."""
    return [plain_gemma3.generate_ids(p, NEW_TOKENS)["output_ids"] for p in prompt_ids]


def _check_token_exact(srv, prompt_ids, reference) -> list[dict]:
    """Alone, all at once (one batch of every prompt), and on a cached prefix: the reference's tokens.
    Returns the lone requests' meta_info."""
    alone = [srv.generate_ids(p, NEW_TOKENS) for p in prompt_ids]
    assert [o["output_ids"] for o in alone] == reference
    with cf.ThreadPoolExecutor(len(prompt_ids)) as pool:
        together = list(pool.map(lambda p: srv.generate_ids(p, NEW_TOKENS), prompt_ids))
    assert [o["output_ids"] for o in together] == reference
    cached = [srv.generate_ids(p + r[:CACHED], NEW_TOKENS - CACHED) for p, r in zip(prompt_ids, reference)]
    assert [o["output_ids"] for o in cached] == [r[CACHED:] for r in reference]
    assert all(o["meta_info"]["cached_tokens"] >= len(p) for o, p in zip(cached, prompt_ids))
    return [o["meta_info"] for o in alone]


def test_the_fixture_slides_a_short_window_on_most_layers(tiny_models):
    cfg = json.loads((tiny_models["gemma3"] / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["sliding_window"] == W
    assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}
    head = json.loads((tiny_models["gemma3-eagle3"] / "config.json").read_text())
    assert head["architectures"] == ["LlamaForCausalLMEagle3"]
    assert max(head["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) < cfg["num_hidden_layers"]


@pytest.mark.server
def test_plain_server_matches_hf_through_the_window(tiny_models, prompt_ids, reference, plain_gemma3):
    """Token-exact against HF; HF without the window gives other tokens for every prompt within the
    first 4, so a server attending past the window (or short of it) could not match. Then batched,
    and on a cached prefix (prompt + outputs, extended through the window)."""
    assert reference == hf_greedy(tiny_models["gemma3"], prompt_ids, NEW_TOKENS)
    unwindowed = hf_greedy(tiny_models["gemma3"], prompt_ids, 4, sliding_window=4096)
    assert all(r[:4] != u for r, u in zip(reference, unwindowed)), unwindowed
    # the greedy outputs are not degenerate: varied stretches and repeats (retrieval has some to accept)
    assert all(len(set(r)) >= 10 for r in reference), reference
    _check_token_exact(plain_gemma3, prompt_ids, reference)


def _graft_args(tiny_models, *extra) -> list[str]:
    return ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["gemma3-eagle3"]),
            *extra]


@pytest.mark.server
def test_graft_full_trees_token_exact(tiny_models, server_logs, prompt_ids, reference):
    """Fixed budget of 20 nodes: every step drafts 3 levels of 4 beams and keeps 10 draft nodes
    (thresholds 0: no checkpoint cuts the draft), 9 slots left to retrieved chains. The EAGLE-3 head's
    layer slides too: ``LlamaForCausalLMEagle3`` reads ``--speculative-draft-window-size`` whatever the
    algorithm (SGLang's start-up warning that GRAFT ignores it is wrong), so its draft extend and its
    4-wide draft decode attend to the query and the 4 keys before it. A random head's drafts are never
    accepted: that the draft ran windowed shows in no token, only that nothing broke."""
    args = _graft_args(tiny_models, "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
                       "--speculative-num-draft-tokens", "20", "--speculative-graft-budget-mode", "fixed",
                       "--speculative-graft-thresholds", "0", "0", "0",
                       "--speculative-graft-min-retrieval-slots", "9", "--speculative-draft-window-size", "4",
                       "--speculative-graft-per-step-metrics")
    with SGLangServer(tiny_models["gemma3"], args, log_path=server_logs / "gemma3-graft-fixed.log") as srv:
        metas = _check_token_exact(srv, prompt_ids, reference)
        log = srv.tail(10 ** 8)
    assert "Traceback" not in log
    for m in metas:
        steps = m["graft_steps"]
        assert m["spec_verify_ct"] == len(steps["stage"]) > 0
        assert all(s == 3 for s in steps["stage"]), steps["stage"]  # the whole draft kept, every step
        assert min(steps["proposed"]) >= 10, steps["proposed"]  # a 3-level tree of >= 11 nodes verified
        hist = m["spec_correct_drafts_histogram"]
        assert sum(hist) == m["spec_verify_ct"]
        assert m["completion_tokens"] == NEW_TOKENS
    # retrieved chains were accepted, one of them longer than the window (its deepest nodes must not
    # see the root), and the tokens after it are still HF's
    assert sum(m["graft_retrieved_accepted"] for m in metas) > 0
    assert max(len(m["spec_correct_drafts_histogram"]) - 1 for m in metas) >= W


@pytest.mark.server
def test_graft_cost_aware_defaults_token_exact(tiny_models, server_logs, prompt_ids, reference, tmp_path):
    """The served tests' flags (3 levels of 2 beams, up to 8 nodes, the cost-aware budget). Step
    costs pinned: the budgets chosen, and so the trees verified, do not depend on the machine's load."""
    args = _graft_args(tiny_models, "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                       "--speculative-num-draft-tokens", "8", "--speculative-graft-per-step-metrics")
    with SGLangServer(tiny_models["gemma3"], args, log_path=server_logs / "gemma3-graft-cost.log",
                      env=pinned_env(tmp_path / "pinned")) as srv:
        metas = _check_token_exact(srv, prompt_ids, reference)
    proposed = [n for m in metas for n in m["graft_steps"]["proposed"]]
    assert max(proposed) > 1, proposed  # trees deeper than one node past the root were verified


# -- tree verify attention with a window, node by node -----------------------------------------------
def _tree(parent):
    """Depths and the ancestor-or-self mask [E, E] of a tree given as parent ids (root: -1)."""
    n = len(parent)
    depth, mask = [0] * n, torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parent[j]
        depth[i] = int(mask[i].sum()) - 1
    return depth, mask


@pytest.mark.parametrize("window", [W, 3])
def test_tree_verify_attention_slides_along_each_branch(window):
    """``extend_attention_cpu`` (the CPU port's kernel for the ``intel_amx`` backend) with a tree
    mask and a window (the backend passes HF's ``sliding_window``: key j is seen from position p
    when p - j < window): each node's output is plain causal windowed attention over its own branch
    read as a sequence (prefix, then root .. node at positions prefix + depth). Two requests, one
    prefix longer than the window and one shorter, each its own tree with a chain deeper than the
    window."""
    from sglang_cpu_port.attention import extend_attention_cpu

    parents = [[-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 11, 1, 13, 3, 4, 12],  # a chain of depth 10, side branches
               [-1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]  # two chains of depth 9 and 8
    trees = [_tree(parent) for parent in parents]
    E, H, Hkv, D, scale = len(parents[0]), 4, 2, 8, 0.3
    prefixes = [21, 2]
    g = torch.Generator().manual_seed(window)
    pool = 128
    k_buf, v_buf = torch.randn(pool, Hkv, D, generator=g), torch.randn(pool, Hkv, D, generator=g)
    slots = (torch.randperm(pool - 1, generator=g) + 1).tolist()  # scattered, as after prefix-cache reuse
    req_to_token = torch.zeros(3, 64, dtype=torch.int32)
    rows = {}
    for b, (r, prefix) in enumerate(zip([2, 0], prefixes)):
        rows[b] = [slots.pop() for _ in range(prefix + E)]
        req_to_token[r, : prefix + E] = torch.tensor(rows[b], dtype=torch.int32)
    q = torch.randn(2 * E, H, D, generator=g)
    out = torch.full((2 * E, H, D), float("nan"))
    extend_attention_cpu(q, None, None, out, k_buf, v_buf, 1.0, 1.0, req_to_token, torch.tensor([2, 0]),
                         torch.tensor([p + E for p in prefixes]), torch.tensor([E, E]), torch.tensor([0, E]), E,
                         scale, 0.0, False, window, None, None, torch.stack([m for _, m in trees]).reshape(-1), True)
    for b, prefix in enumerate(prefixes):
        depth, mask = trees[b]
        assert max(depth) >= window  # the chains' deepest nodes do not see their root
        for i in range(E):
            branch = [j for j in range(E) if mask[i, j]]  # root .. node, by depth
            seq = rows[b][:prefix] + [rows[b][prefix + j] for j in sorted(branch, key=depth.__getitem__)]
            seen = seq[-window:]  # position prefix + depth[i] sees the last `window` positions
            assert len(seq) == prefix + depth[i] + 1
            for h in range(H):
                k, v = k_buf[seen, h // (H // Hkv)].double(), v_buf[seen, h // (H // Hkv)].double()
                w = torch.softmax(scale * (k @ q[b * E + i, h].double()), dim=0)
                torch.testing.assert_close(out[b * E + i, h], (w @ v).float(), rtol=1e-5, atol=1e-5)

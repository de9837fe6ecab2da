"""Losslessness of target-only tree sampling on hybrid (draft + retrieved, merged) trees.

A context-dependent target model assigns every token path its own logits. The first emitted
token must follow the target at the root, and the first two tokens must follow
``q(root)[x1] * q(root, x1)[x2]``, where a second token not emitted by the first round comes
from a second verification round on a fresh hybrid tree rooted at ``x1``. Each check draws
>= 20k independent verifications as one batch and runs a chi-square test (p > 0.01, fixed
seeds). A negative control shows the test rejects a tree with a duplicated sibling.
"""

from __future__ import annotations

import pytest
import torch
from test_tree_support import DEVICES, chi2_pvalue, random_proposals, simulate_eagle_draft

from sglang_graft.tree import (
    PruneConfig,
    build_graft_tree,
    draft_pool_from_sglang,
    flatten,
    target_probs_from_logits,
    verify_tree_sampling,
)
from sglang_graft.tree.verify import emitted_tokens

VOCAB = 6
N = 14
DRAWS = 24_000
TOP_K_ALL = 1 << 30
SETTINGS = [
    (1.0, 1.0, TOP_K_ALL),
    (0.7, 0.9, TOP_K_ALL),
    (1.3, 1.0, 3),
    (0.8, 0.8, 4),
]


class PathTarget:
    """Target model: logits are a fixed random function of the whole token path."""

    def __init__(self, seed: int, temperature: float, top_p: float, top_k: int):
        self.seed, self.t, self.p, self.k = seed, temperature, top_p, top_k
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}

    def probs(self, path: tuple[int, ...]) -> torch.Tensor:
        if path not in self.cache:
            gen = torch.Generator().manual_seed((hash(path) ^ self.seed) & 0x7FFFFFFF)
            logits = torch.randn(1, 1, VOCAB, generator=gen) * 1.5
            self.cache[path] = target_probs_from_logits(
                logits, torch.tensor([self.t]), torch.tensor([self.p]), torch.tensor([self.k])
            )[0, 0]
        return self.cache[path]

    def tree_rows(self, tokens: torch.Tensor, parents: torch.Tensor, prefix: tuple[int, ...]) -> torch.Tensor:
        """``[bs, N, V]`` target rows of every node (padding rows included)."""
        rows = torch.empty(tokens.shape + (VOCAB,))
        for b in range(tokens.shape[0]):
            tok, par = tokens[b].tolist(), parents[b].tolist()
            for i in range(tokens.shape[1]):
                path, j = [], i
                while j >= 0:
                    path.append(tok[j])
                    j = par[j]
                rows[b, i] = self.probs(prefix + tuple(reversed(path)))
        return rows


def hybrid_trees(seed: int, roots: torch.Tensor, r: int = 11):
    """Hybrid trees (draft pruned to a few nodes, retrieval merged and grafted at the root)."""
    bs = roots.numel()
    gen = torch.Generator().manual_seed(seed)
    s, t, p = simulate_eagle_draft(bs, 3, 3, VOCAB, gen)
    pool = draft_pool_from_sglang(s, t, p, 3, 3)
    proposals = random_proposals(bs, r, VOCAB, gen, pool=pool, copy_len=3, invalid_tail=3)
    config = PruneConfig(checkpoint_depths=(0,), thresholds=(1.0,), keep_per_stage=(5,))
    return build_graft_tree(pool, roots, proposals, torch.zeros(bs, dtype=torch.long), N, config)


def mixed_tree(base_seed: int, root: int):
    """First hybrid tree (deterministic seed search) whose root has both draft and retrieved
    children, with merged proposal nodes and padding."""
    for seed in range(base_seed, base_seed + 200):
        step = hybrid_trees(seed, torch.tensor([root]))
        tree = step.tree
        root_kids = (tree.parents[0] == 0) & tree.linked[0]
        if (
            bool((root_kids & tree.from_draft[0]).any())
            and bool((root_kids & ~tree.from_draft[0]).any())
            and int(tree.num_merged[0]) > 0
            and bool((~tree.linked[0, 1:]).any())
            and int(step.layout.max_depth[0]) >= 3
        ):
            return step
    raise AssertionError("no suitable tree")


def _verify(tree_tokens, layout, rows, pick, gen, device):
    """Verify ``len(pick)`` draws; draw ``d`` uses tree ``pick[d]``."""
    links = [tree_tokens, layout.flat_index, layout.first_child, layout.next_sibling]
    links = [x[pick].to(device) for x in links]
    # Each draw is its own request: rows b*N + i.
    links[1] = (torch.arange(len(pick), device=device)[:, None] * N + torch.arange(N, device=device)).contiguous()
    probs = rows[pick].to(device)
    coins = torch.rand((len(pick), N), generator=gen).to(device)
    final = torch.rand((len(pick),), generator=gen).to(device)
    out = verify_tree_sampling(*links, probs, coins, final)
    return emitted_tokens(*(x.cpu() for x in out))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_first_and_first_two_tokens_follow_the_target(device, setting):
    temperature, top_p, top_k = SETTINGS[setting]
    target = PathTarget(seed=100 + setting, temperature=temperature, top_p=top_p, top_k=top_k)
    root = 2
    # The tree mixes draft and retrieved children and contains merged nodes and padding.
    step = mixed_tree(100 * setting, root)
    tree = step.tree
    rows = target.tree_rows(tree.tokens, tree.parents, prefix=())
    gen = torch.Generator().manual_seed(1000 + setting)
    tokens, count = _verify(tree.tokens, step.layout, rows, torch.zeros(DRAWS, dtype=torch.long), gen, device)

    q_root = target.probs((root,))
    x1 = tokens[:, 0]
    assert chi2_pvalue(torch.bincount(x1, minlength=VOCAB), q_root) > 0.01

    # Second token: from the same round when it emitted two tokens, else from a new round on
    # a hybrid tree rooted at x1 (one per possible x1).
    step2 = hybrid_trees(seed=50 + setting, roots=torch.arange(VOCAB))
    rows2 = torch.cat([target.tree_rows(step2.tree.tokens[v : v + 1], step2.tree.parents[v : v + 1], (root,))
                       for v in range(VOCAB)])
    x2 = tokens[:, 1].clone()
    need = count < 2
    t2, _ = _verify(step2.tree.tokens, step2.layout, rows2, x1[need], gen, device)
    x2[need] = t2[:, 0]
    expected = torch.stack([q_root[a] * target.probs((root, a)) for a in range(VOCAB)])  # [V, V]
    observed = torch.bincount(x1 * VOCAB + x2, minlength=VOCAB * VOCAB)
    assert chi2_pvalue(observed, expected) > 0.01


def test_greedy_settings_emit_the_argmax():
    target = PathTarget(seed=7, temperature=0.0, top_p=1.0, top_k=TOP_K_ALL)
    step = hybrid_trees(seed=9, roots=torch.tensor([1]))
    rows = target.tree_rows(step.tree.tokens, step.tree.parents, prefix=())
    tokens, _ = _verify(step.tree.tokens, step.layout, rows, torch.zeros(2000, dtype=torch.long),
                        torch.Generator().manual_seed(0), "cpu")
    assert bool((tokens[:, 0] == int(target.probs((1,)).argmax())).all())


def test_a_duplicated_sibling_is_detected():
    """Negative control: turning a padding slot into a second copy of a root child (what an
    unmerged graft would produce) skews the first token, and the chi-square test sees it."""
    target = PathTarget(seed=3, temperature=1.0, top_p=1.0, top_k=TOP_K_ALL)
    root = 2
    step = mixed_tree(0, root)
    tree = step.tree
    tokens, parents, linked = tree.tokens.clone(), tree.parents.clone(), tree.linked.clone()
    pad_slot = int(torch.nonzero(~linked[0, 1:])[0]) + 1
    q_root = target.probs((root,))
    kids = [i for i in range(N) if parents[0, i] == 0 and linked[0, i]]
    best = max(kids, key=lambda i: float(q_root[tokens[0, i]]))
    tokens[0, pad_slot], parents[0, pad_slot], linked[0, pad_slot] = tokens[0, best], 0, True
    layout = flatten(tokens, parents, torch.zeros(1, dtype=torch.long), linked)
    rows = target.tree_rows(tokens, parents, prefix=())
    out, _ = _verify(tokens, layout, rows, torch.zeros(DRAWS, dtype=torch.long), torch.Generator().manual_seed(1),
                     "cpu")
    assert chi2_pvalue(torch.bincount(out[:, 0], minlength=VOCAB), q_root) < 1e-6

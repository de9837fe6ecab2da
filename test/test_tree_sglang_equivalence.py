"""The tree layout and greedy verification agree with SGLang's own kernels.

SGLang's Triton twins (``sgl_build_tree_kernel_triton``, ``verify_tree_greedy_triton``,
``reconstruct_indices_from_tree_mask_triton``) are run from the installed SGLang sources by
the Triton interpreter on CPU tensors. A plain-Python restatement of the CUDA kernel
(``eagle.cuh``) covers the bit-packed mask, which the Triton twin does not implement.
"""

from __future__ import annotations

import pytest
import torch
from test_tree_support import (
    organize_draft_results,
    random_proposals,
    simulate_eagle_draft,
    sglang_triton_kernels,
)

from sglang_graft.tree import (
    PruneConfig,
    RetrievalProposals,
    TreeMaskMode,
    build_graft_tree,
    draft_pool_from_sglang,
    flatten,
    sglang_draft_tree_layout,
    tree_layout_from_mask,
    verify_tree_greedy,
)
from sglang_graft.tree.draft import build_tree_from_sglang_draft
from sglang_graft.tree.flatten import full_tree_mask

# (bs, topk, num_steps, N)
DRAFT_CONFIGS = [(2, 2, 3, 6), (3, 4, 3, 12), (2, 3, 4, 16), (1, 1, 3, 4), (2, 2, 1, 3), (1, 4, 5, 20)]


def _sglang_build(parent_list, top_scores_index, seq_lens, topk, depth, n, mode):
    """SGLang's tree kernel with the buffers ``build_tree_kernel_efficient`` prepares."""
    k = sglang_triton_kernels()
    bs = seq_lens.numel()
    if mode == TreeMaskMode.FULL_MASK:
        tree_mask = torch.full((int(seq_lens.sum()) * n + n * n * bs,), True)
    else:
        tree_mask = torch.full((n * bs * n,), True)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
    positions = torch.empty((bs * n,), dtype=torch.long)
    k.call(
        "sgl_build_tree_kernel_triton",
        parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve[0], retrieve[1], retrieve[2],
        topk, depth, n, int(mode),
    )
    return tree_mask, positions, retrieve[0], retrieve[1], retrieve[2]


def _draft(bs, topk, steps, n, seed, vocab=50):
    gen = torch.Generator().manual_seed(seed)
    s, t, p = simulate_eagle_draft(bs, topk, steps, vocab, gen)
    parent_list, top, draft_tokens = organize_draft_results(s, t, p, n)
    seq_lens = torch.randint(1, 9, (bs,), generator=gen)
    verified = torch.randint(0, vocab, (bs,), generator=gen)
    return (s, t, p), parent_list, top, draft_tokens, seq_lens, verified


def _orphan_selection(parent_list, top, topk, m):
    """Replace a selected parent of a selected node by an unselected candidate (a broken
    draft, e.g. from NaN scores) to exercise the kernel's 'parent not found' path."""
    top = top.clone()
    for b in range(top.shape[0]):
        sel = top[b].tolist()
        for s in sel:
            blk = s // topk
            if blk > 0:
                parent = int(parent_list[b, blk])
                if parent in sel:
                    spare = next(c for c in range(m) if c not in sel)
                    sel[sel.index(parent)] = spare
                    top[b] = torch.tensor(sorted(sel))
                    break
    return top


@pytest.mark.parametrize("mode", [TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY])
@pytest.mark.parametrize("bs,topk,steps,n", DRAFT_CONFIGS)
def test_build_tree_matches_sglang_triton_kernel(bs, topk, steps, n, mode):
    _, parent_list, top, draft_tokens, seq_lens, verified = _draft(bs, topk, steps, n, seed=bs * 100 + n)
    ref = _sglang_build(parent_list, top, seq_lens, topk, steps, n, mode)
    got = build_tree_from_sglang_draft(verified, parent_list, top, draft_tokens, seq_lens, n, topk, steps, mode)
    names = ["tree_mask", "positions", "flat_index", "first_child", "next_sibling"]
    for name, a, b in zip(names, got[:5], ref):
        assert torch.equal(a, b), name
    assert torch.equal(got[5], torch.cat([verified[:, None], draft_tokens], 1).flatten())


@pytest.mark.parametrize("bs,topk,steps,n", [(2, 2, 3, 6), (2, 3, 4, 12)])
def test_build_tree_orphan_matches_sglang_triton_kernel(bs, topk, steps, n):
    _, parent_list, top, _, seq_lens, _ = _draft(bs, topk, steps, n, seed=7 + n)
    m = topk + (steps - 1) * topk * topk
    top = _orphan_selection(parent_list, top, topk, m)
    for mode in (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY):
        ref = _sglang_build(parent_list, top, seq_lens, topk, steps, n, mode)
        layout = sglang_draft_tree_layout(parent_list, top, seq_lens, topk, steps, n, mode)
        got = [layout.tree_mask, layout.positions, layout.flat_index, layout.first_child,
               layout.next_sibling]
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    # The orphan (depth 1 in the mask) is reachable from no list.
    assert bool((layout.positions.view(bs, n) - seq_lens[:, None] == 1).any())


def test_build_tree_degenerate_selection_matches_sglang_triton_kernel():
    """Rows of a CUDA-graph-padded batch can carry any selection: all zeros, repeats."""
    bs, topk, steps, n = 3, 2, 3, 7
    _, parent_list, top, _, seq_lens, _ = _draft(bs, topk, steps, n, seed=1)
    top[0] = 0
    top[1] = torch.tensor([0, 1, 2, 2, 5, 5])
    seq_lens[2] = 1
    for mode in (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY):
        ref = _sglang_build(parent_list, top, seq_lens, topk, steps, n, mode)
        layout = sglang_draft_tree_layout(parent_list, top, seq_lens, topk, steps, n, mode)
        got = [layout.tree_mask, layout.positions, layout.flat_index, layout.first_child,
               layout.next_sibling]
        for a, b in zip(got, ref):
            assert torch.equal(a, b)


@pytest.mark.parametrize("bs,topk,steps,n", [(2, 2, 3, 6), (3, 4, 3, 12), (2, 3, 4, 16)])
def test_graft_pipeline_draft_only_equals_sglang_tree(bs, topk, steps, n):
    """prune (all checkpoints pass) -> graft (no retrieval) -> flatten == SGLang's builder."""
    (s, t, p), parent_list, top, draft_tokens, seq_lens, verified = _draft(bs, topk, steps, n, seed=3 * n)
    pool = draft_pool_from_sglang(s, t, p, topk, steps)
    config = PruneConfig(checkpoint_depths=(0,), thresholds=(0.0,), keep_per_stage=(1,))
    step = build_graft_tree(pool, verified, RetrievalProposals.empty(bs), seq_lens, n, config)
    assert torch.equal(step.tree.draft_index[:, 1:], top)  # same candidates as organize_draft_results
    ref = _sglang_build(parent_list, top, seq_lens, topk, steps, n, TreeMaskMode.FULL_MASK)
    layout = step.layout
    full = full_tree_mask(layout.ancestor_mask, seq_lens, int(seq_lens.sum()))
    got = [full, layout.positions, layout.flat_index, layout.first_child, layout.next_sibling]
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert torch.equal(layout.draft_token, torch.cat([verified[:, None], draft_tokens], 1).flatten())


def _hybrid_layout(bs, n, seed, vocab=5):
    gen = torch.Generator().manual_seed(seed)
    s, t, p = simulate_eagle_draft(bs, 2, 4, vocab, gen)
    pool = draft_pool_from_sglang(s, t, p, 2, 4)
    proposals = random_proposals(bs, n, vocab, gen, pool=pool)
    config = PruneConfig(checkpoint_depths=(0, 1), thresholds=(0.3, 0.2), keep_per_stage=(2, 5))
    seq_lens = torch.randint(0, 6, (bs,), generator=gen)
    step = build_graft_tree(pool, torch.randint(0, vocab, (bs,), generator=gen), proposals, seq_lens, n, config)
    return step, gen


@pytest.mark.parametrize("seed", range(4))
def test_verify_greedy_matches_sglang_triton_kernel(seed):
    bs, n = 3, 12
    step, gen = _hybrid_layout(bs, n, seed)
    tree, layout = step.tree, step.layout
    # Targets that follow a random linked child most of the time, so paths get deep.
    target = torch.randint(0, 5, (bs, n), generator=gen)
    nxt = layout.first_child
    follow = (torch.rand(bs, n, generator=gen) < 0.8) & (nxt >= 0)
    target = torch.where(follow, tree.tokens.gather(1, nxt.clamp(min=0)), target)
    for width in (n, 3):
        k = sglang_triton_kernels()
        ref_pred = torch.zeros(bs * n, dtype=torch.int32)
        ref_acc = torch.full((bs, width), -1, dtype=torch.int32)
        ref_num = torch.empty(bs, dtype=torch.int32)
        k.call(
            "verify_tree_greedy_triton",
            ref_pred, ref_acc, ref_num, tree.tokens, layout.flat_index, layout.first_child,
            layout.next_sibling, target,
        )
        pred, acc, num = verify_tree_greedy(
            tree.tokens, layout.flat_index, layout.first_child, layout.next_sibling, target, width
        )
        assert torch.equal(pred, ref_pred) and torch.equal(acc, ref_acc) and torch.equal(num, ref_num)


@pytest.mark.parametrize("seed", range(3))
def test_tree_layout_from_mask_matches_sglang_triton_kernel(seed):
    bs, n = 3, 10
    step, gen = _hybrid_layout(bs, n, seed + 10)
    mask = step.layout.ancestor_mask
    # Include a mask whose numbering is not BFS, where "first descendant" != "first child".
    parents = torch.tensor([[-1, 0, 1, 0, 2, 3, 0, 6, 1, 4]])
    mask = torch.cat([mask, flatten(None, parents, torch.zeros(1, dtype=torch.long)).ancestor_mask])
    seq_lens = torch.randint(0, 9, (bs + 1,), generator=gen)
    k = sglang_triton_kernels()
    ref = torch.empty((4, bs + 1, n), dtype=torch.long)
    k.call(
        "reconstruct_indices_from_tree_mask_triton",
        mask.flatten(), seq_lens, ref[0].view(-1), ref[1], ref[2], ref[3], bs + 1, n,
    )
    got = tree_layout_from_mask(mask, seq_lens)
    assert torch.equal(got.positions, ref[0].view(-1))
    assert torch.equal(got.flat_index, ref[1])
    assert torch.equal(got.first_child, ref[2])
    assert torch.equal(got.next_sibling, ref[3])


def _cuda_kernel_restated(parent_list, selected, seq_lens, topk, depth, n, packed: bool):
    """``build_tree_efficient`` / ``..._partial_packed`` of eagle.cuh, line by line in Python."""
    bs = seq_lens.numel()
    sel = selected.tolist()
    pl = parent_list.tolist()
    positions = [0] * (bs * n)
    ri = [[-1] * n for _ in range(bs)]
    nt = [[-1] * n for _ in range(bs)]
    ns = [[-1] * n for _ in range(bs)]
    rows = [[[False] * n for _ in range(n)] for _ in range(bs)]
    for b in range(bs):
        seq_len = int(seq_lens[b])
        for tid in range(n):
            rows[b][tid][0] = True
            if tid == 0:
                positions[b * n] = seq_len
                for i in range(n - 1, 0, -1):
                    ri[b][i] = b * n + i
                    parent_tb_idx = sel[b][i - 1] // topk
                    parent_position = 0
                    if parent_tb_idx > 0:
                        parent_token_idx = pl[b][parent_tb_idx]
                        while parent_position < n:
                            if sel[b][parent_position] == parent_token_idx:
                                parent_position += 1
                                break
                            parent_position += 1
                    if parent_position == n:
                        continue
                    if nt[b][parent_position] != -1:
                        ns[b][i] = nt[b][parent_position]
                    nt[b][parent_position] = i
                ri[b][0] = b * n
            else:
                cur, position = tid - 1, 0
                while True:
                    position += 1
                    rows[b][tid][cur + 1] = True
                    parent_tb_idx = sel[b][cur] // topk
                    if parent_tb_idx == 0:
                        break
                    token_idx = pl[b][parent_tb_idx]
                    cur = next(c for c in range(n - 1) if sel[b][c] == token_idx)
                positions[b * n + tid] = position + seq_len
    anc = torch.tensor(rows)
    return anc, torch.tensor(positions), torch.tensor(ri), torch.tensor(nt), torch.tensor(ns)


@pytest.mark.parametrize("bs,topk,steps,n", [(2, 2, 3, 6), (3, 4, 3, 12), (2, 3, 4, 16), (1, 4, 5, 32)])
def test_layout_matches_cuda_kernel_restatement(bs, topk, steps, n):
    _, parent_list, top, _, seq_lens, _ = _draft(bs, topk, steps, n, seed=11 * n)
    anc, positions, ri, nt, ns = _cuda_kernel_restated(parent_list, top, seq_lens, topk, steps, n, packed=False)
    for mode in TreeMaskMode:
        layout = sglang_draft_tree_layout(parent_list, top, seq_lens, topk, steps, n, mode)
        assert torch.equal(layout.positions, positions)
        assert torch.equal(layout.flat_index, ri)
        assert torch.equal(layout.first_child, nt)
        assert torch.equal(layout.next_sibling, ns)
        assert torch.equal(layout.ancestor_mask, anc)
        if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
            # Little-endian bytes of the packed rows: byte k holds columns 8k..8k+7.
            nbytes = layout.tree_mask.element_size()
            raw = layout.tree_mask.view(torch.uint8).view(bs * n, nbytes)
            bits = torch.stack([(raw[:, c // 8] >> (c % 8)) & 1 for c in range(n)], dim=1).bool()
            assert torch.equal(bits, anc.view(bs * n, n))
            assert layout.tree_mask.dtype == (torch.uint8, torch.uint16, torch.uint32)[(n > 8) + (n > 16)]

"""``graft_step``: prune -> graft -> flatten of one request per program (the published placement).

Bit-exact with ``sglang_graft.tree.build_graft_tree(..., placement="root")`` and mirrors its
steps one by one (see ``tree/prune.py``, ``tree/graft.py``, ``tree/flatten.py`` for the rules):

1. **prune**: the confidence at each checkpoint, the stage, the number of draft nodes to keep
   (the stage's table entry, capping the caller's ``num_keep``), the path minimum of the scores and
   each candidate's rank (descending, ties by pool index) -> ``keep``;
2. **graft**: kept draft nodes to slots ``1..``, then the retrieved nodes: validity and priority
   along their paths, duplicate siblings dropped with their subtrees, a retrieved node whose
   token path equals a kept draft node's is merged into it, the rest ranked into the free slots;
3. **flatten**: the verify layout of the ``N`` slots (``tree_layout``'s code).

Gathers along parent pointers go through a per-request scratch row in global memory (store,
barrier, load at the pointers), the way the torch reference gathers: no ``[M, M]`` register tile,
so pools of a few hundred candidates fit one program. No host read; fixed launch shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tree_layout import MAX_NODES, _layout_rows, jump_rounds, layout_args, layout_outputs

FLT_MAX = 3.4028234663852886e38


@triton.jit
def _nan_min(a, b):
    """``torch.minimum``: NaN wins."""
    return tl.where((a != a) | (b != b), float("nan"), tl.minimum(a, b))


@triton.jit
def _nan_to_num(x):
    """``torch.nan_to_num(x, nan=-inf)``: NaN -> -inf, +inf -> FLT_MAX, -inf -> -FLT_MAX."""
    big = 3.4028234663852886e38
    y = tl.where(x == float("inf"), big, tl.where(x == -float("inf"), -big, x))
    return tl.where(x != x, -float("inf"), y)


@triton.jit
def _gather(scratch, values, index, lanes, ok):
    """``values[index]`` through a scratch row (``index`` may be the sentinel slot, pre-filled)."""
    tl.store(scratch + lanes, values, mask=ok)
    tl.debug_barrier()
    out = tl.load(scratch + index)
    tl.debug_barrier()
    return out


@triton.jit
def _path_reduce_min(scratch_f, scratch_i, values, jump, lanes, ok, SENT: tl.constexpr, ROUNDS: tl.constexpr):
    """Minimum over each node's root path (NaN propagates); the sentinel ``SENT`` holds +inf."""
    tl.store(scratch_f + SENT, float("inf"))
    tl.store(scratch_i + SENT, SENT)
    acc = values
    for _ in tl.static_range(ROUNDS):
        g = _gather(scratch_f, acc, jump, lanes, ok)
        jump = _gather(scratch_i, jump, jump, lanes, ok)
        acc = _nan_min(acc, g)
    return acc


@triton.jit
def _path_reduce_and(scratch_i, values, jump, lanes, ok, IDENTITY: tl.constexpr, SENT: tl.constexpr,
                     ROUNDS: tl.constexpr, USE_OR: tl.constexpr):
    """AND (or OR) of 0/1 int64 ``values`` over each node's root path."""
    acc = values
    j = jump
    for _ in tl.static_range(ROUNDS):
        tl.store(scratch_i + SENT, IDENTITY)
        g = _gather(scratch_i, acc, j, lanes, ok)
        tl.store(scratch_i + SENT, SENT)
        j = _gather(scratch_i, j, j, lanes, ok)
        acc = (acc | g) if USE_OR else (acc & g)
    return acc


@triton.jit
def _prune(
    pool_tok_ptr, pool_par_ptr, pool_sc_ptr, pool_dep_ptr, ckpt_ptr, thr_ptr, keep_table_ptr, num_keep_ptr,
    depth_limit_ptr, keep_ptr, stage_ptr, conf_ptr, num_kept_ptr, ws_f, ws_i, b,
    M: tl.constexpr, N: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, CH: tl.constexpr,
    ROUNDS_M: tl.constexpr, HAS_NUM_KEEP: tl.constexpr, HAS_DEPTH_LIMIT: tl.constexpr,
):
    """1. prune: confidences, stage, how many to keep, the ranked keep set (``prune_by_confidence``)."""
    m = tl.arange(0, BM).to(tl.int64)
    mok = m < M
    p_tok = tl.load(pool_tok_ptr + b * M + m, mask=mok, other=0).to(tl.int64)
    p_par = tl.load(pool_par_ptr + b * M + m, mask=mok, other=-1).to(tl.int64)
    p_sc = tl.load(pool_sc_ptr + b * M + m, mask=mok, other=0.0).to(tl.float32)
    p_dep = tl.load(pool_dep_ptr + b * M + m, mask=mok, other=-1).to(tl.int64)

    stage = tl.full([], C, tl.int64)
    for k in tl.static_range(C):
        d = tl.load(ckpt_ptr + k)
        at = mok & (p_dep == d)
        has_nan = tl.max(tl.where(at & (p_sc != p_sc), 1, 0), axis=0) > 0
        conf = tl.max(tl.where(at & (p_sc == p_sc), p_sc, -float("inf")), axis=0)
        conf = tl.where(has_nan, float("nan"), conf)
        tl.store(conf_ptr + b * C + k, conf)
        stage = tl.where((stage == C) & (conf < tl.load(thr_ptr + k)), k, stage)
    nk = tl.load(keep_table_ptr + stage).to(tl.int64)
    if HAS_NUM_KEEP:
        nk = tl.minimum(tl.load(num_keep_ptr + b).to(tl.int64), nk)
    nk = tl.minimum(nk, N - 1)
    if HAS_DEPTH_LIMIT:
        allowed = p_dep <= tl.load(depth_limit_ptr + b).to(tl.int64)
    else:
        allowed = mok

    jump_m = tl.where(p_par < 0, M, p_par)
    pm = _path_reduce_min(ws_f, ws_i, p_sc, jump_m, m, mok, M, ROUNDS_M)
    pm = _nan_to_num(pm)
    pm = tl.where(allowed, pm, -float("inf"))
    # rank = candidates ahead (higher path minimum, or equal and earlier)
    tl.store(ws_f + m, pm, mask=mok)
    tl.debug_barrier()
    rank = tl.zeros([BM], dtype=tl.int64)
    for c in tl.static_range(0, BM, CH):
        j = c + tl.arange(0, CH).to(tl.int64)
        pj = tl.load(ws_f + j, mask=j < M, other=0.0)
        ahead = ((pj[None, :] > pm[:, None]) | ((pj[None, :] == pm[:, None]) & (j[None, :] < m[:, None])))
        rank += tl.sum((ahead & (j[None, :] < M)).to(tl.int64), axis=1)
    tl.debug_barrier()
    keep = mok & (rank < nk) & allowed
    num_draft = tl.sum(keep.to(tl.int64), axis=0)
    tl.store(keep_ptr + b * M + m, keep.to(tl.int8), mask=mok)
    tl.store(stage_ptr + b, stage)
    tl.store(num_kept_ptr + b, num_draft)

    return m, mok, p_tok, p_par, keep, num_draft


@triton.jit
def _place_draft(
    root_ptr, tokens_ptr, parents_ptr, from_draft_ptr, from_ret_ptr, draft_index_ptr, ret_index_ptr, ws_i, b,
    m, mok, p_tok, p_par, keep, pad_token_id, M: tl.constexpr, N: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr,
):
    """2a. graft, draft side: slot 0 the root, kept draft nodes at slots 1.. in pool order, the rest
    padding under the root. Returns the slot lanes, their mask and the request's slot rows."""
    s = tl.arange(0, BN).to(tl.int64)
    sok = s < N
    row = b * N + s
    root = tl.load(root_ptr + b).to(tl.int64)
    tl.store(tokens_ptr + row, tl.where(s == 0, root, pad_token_id), mask=sok)
    tl.store(parents_ptr + row, tl.where(s == 0, -1, 0), mask=sok)
    tl.store(from_draft_ptr + row, tl.zeros([BN], tl.int8), mask=sok)
    tl.store(from_ret_ptr + row, tl.zeros([BN], tl.int8), mask=sok)
    tl.store(draft_index_ptr + row, tl.full([BN], -1, tl.int64), mask=sok)
    tl.store(ret_index_ptr + row, tl.full([BN], -1, tl.int64), mask=sok)
    draft_slot = tl.where(keep, tl.cumsum(keep.to(tl.int64), axis=0), N)
    tl.store(ws_i + M, N)
    parent_slot = tl.where(p_par < 0, 0, _gather(ws_i, draft_slot, tl.where(p_par < 0, M, p_par), m, mok))
    tl.debug_barrier()
    dst = b * N + draft_slot
    tl.store(tokens_ptr + dst, p_tok, mask=keep)
    tl.store(parents_ptr + dst, parent_slot, mask=keep)
    tl.store(from_draft_ptr + dst, tl.full([BM], 1, tl.int8), mask=keep)
    tl.store(draft_index_ptr + dst, m, mask=keep)
    tl.debug_barrier()

    return s, sok, row


@triton.jit
def _graft_retrieved(
    r_tok_ptr, r_par_ptr, r_sc_ptr, r_valid_ptr, tokens_ptr, parents_ptr, from_draft_ptr, from_ret_ptr,
    ret_index_ptr, ret_slot_ptr, num_retrieved_ptr, num_merged_ptr, ws_f, ws_i, ws_m, b, num_draft,
    R: tl.constexpr, N: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
    ROUNDS_R: tl.constexpr, ROUNDS_MATCH: tl.constexpr,
):
    """2b. graft, retrieval side: path validity and priority, duplicate siblings dropped with their
    subtrees, nodes whose token path equals a kept draft node's merged into it, the rest ranked into
    the free slots (``graft``)."""
    r = tl.arange(0, BR).to(tl.int64)
    rok = r < R
    r_tok = tl.load(r_tok_ptr + b * R + r, mask=rok, other=0).to(tl.int64)
    r_par = tl.load(r_par_ptr + b * R + r, mask=rok, other=-1).to(tl.int64)
    r_sc = tl.load(r_sc_ptr + b * R + r, mask=rok, other=0.0).to(tl.float32)
    r_val = (tl.load(r_valid_ptr + b * R + r, mask=rok, other=0) != 0).to(tl.int64)
    jump_r = tl.where(r_par < 0, R, r_par)
    alive = _path_reduce_and(ws_i, r_val, jump_r, r, rok, 1, R, ROUNDS_R, False) != 0
    priority = _path_reduce_min(ws_f, ws_i, _nan_to_num(r_sc), jump_r, r, rok, R, ROUNDS_R)
    dup = (r_par[:, None] == r_par[None, :]) & (r_tok[:, None] == r_tok[None, :]) & alive[None, :] \
        & (r[None, :] < r[:, None]) & rok[None, :]
    dup = tl.max(dup.to(tl.int64), axis=1)
    dup_path = _path_reduce_and(ws_i, dup, jump_r, r, rok, 0, R, ROUNDS_R, True)
    alive = alive & (dup_path == 0) & rok

    # merge: a retrieved node whose token path equals a kept draft node's (draft forest = slots 1..N-1)
    jd = tl.arange(0, BN).to(tl.int64)
    dok_lane = jd < N - 1
    d_tok = tl.load(tokens_ptr + b * N + 1 + jd, mask=dok_lane, other=0)
    d_par = tl.load(parents_ptr + b * N + 1 + jd, mask=dok_lane, other=0) - 1
    d_ok = (tl.load(from_draft_ptr + b * N + 1 + jd, mask=dok_lane, other=0) != 0) & dok_lane
    W: tl.constexpr = BN + 1
    match = alive[:, None] & d_ok[None, :] & (r_tok[:, None] == d_tok[None, :])
    # sentinel row BR / column BN: the two roots match each other and nothing else
    tl.store(ws_m + BR * W + jd, tl.zeros([BN], tl.int8))
    tl.store(ws_m + BR * W + BN, 1)
    tl.store(ws_m + r * W + BN, tl.zeros([BR], tl.int8))
    ja = tl.where(r_par < 0, BR, r_par)
    jb = tl.where(d_par < 0, BN, d_par)
    for _ in tl.static_range(ROUNDS_MATCH):
        tl.store(ws_m + r[:, None] * W + jd[None, :], match.to(tl.int8))
        tl.debug_barrier()
        g = tl.load(ws_m + ja[:, None] * W + jb[None, :]) != 0
        tl.debug_barrier()
        match = match & g
        tl.store(ws_i + BR, BR)
        ja = _gather(ws_i, ja, ja, r, r < BR)
        tl.store(ws_i + BN, BN)
        jb = _gather(ws_i, jb, jb, jd, jd < BN)
    match = match & rok[:, None] & dok_lane[None, :]
    target = tl.min(tl.where(match, jd[None, :], BN), axis=1)
    merge_slot = tl.where(target < BN, target + 1, -1)
    merged = alive & (merge_slot >= 0)
    new = alive & ~merged

    budget = (N - 1) - num_draft
    ahead = new[None, :] & ((priority[None, :] > priority[:, None])
                            | ((priority[None, :] == priority[:, None]) & (r[None, :] < r[:, None])))
    rank_r = tl.sum(ahead.to(tl.int64), axis=1)
    include = new & (rank_r < budget)
    new_slot = num_draft + tl.cumsum(include.to(tl.int64), axis=0)
    ret_slot = tl.where(include, new_slot, tl.where(merged, merge_slot, -1))
    tl.store(ws_i + R, 0)
    parent_of_new = tl.where(r_par < 0, 0, _gather(ws_i, ret_slot, tl.where(r_par < 0, R, r_par), r, rok))
    include = include & (parent_of_new >= 0)
    ret_slot = tl.where(include | merged, ret_slot, -1)
    tl.store(ret_slot_ptr + b * R + r, ret_slot, mask=rok)
    dst = b * N + new_slot
    tl.store(tokens_ptr + dst, r_tok, mask=include)
    tl.store(parents_ptr + dst, tl.maximum(parent_of_new, 0), mask=include)
    tl.store(from_ret_ptr + dst, tl.full([BR], 1, tl.int8), mask=include)
    tl.store(ret_index_ptr + dst, r, mask=include)
    dst = b * N + merge_slot
    tl.store(from_ret_ptr + dst, tl.full([BR], 1, tl.int8), mask=merged)
    tl.store(ret_index_ptr + dst, r, mask=merged)
    tl.store(num_retrieved_ptr + b, tl.sum(include.to(tl.int64), axis=0))
    tl.store(num_merged_ptr + b, tl.sum(merged.to(tl.int64), axis=0))
    tl.debug_barrier()



@triton.jit
def _graft_step_kernel(
    # inputs
    pool_tok_ptr, pool_par_ptr, pool_sc_ptr, pool_dep_ptr, root_ptr, seq_lens_ptr,
    r_tok_ptr, r_par_ptr, r_sc_ptr, r_valid_ptr,
    ckpt_ptr, thr_ptr, keep_table_ptr, num_keep_ptr, depth_limit_ptr,
    # prune outputs
    keep_ptr, stage_ptr, conf_ptr, num_kept_ptr,
    # tree outputs
    tokens_ptr, parents_ptr, from_draft_ptr, from_ret_ptr, linked_ptr, draft_index_ptr, ret_index_ptr,
    ret_slot_ptr, num_retrieved_ptr, num_merged_ptr,
    # layout outputs
    positions_ptr, depth_ptr, bits_ptr, mask_ptr, next_token_ptr, next_sibling_ptr, flat_index_ptr,
    max_depth_ptr,
    # scratch
    ws_f_ptr, ws_i_ptr, ws_m_ptr,
    pad_token_id,
    M: tl.constexpr, R: tl.constexpr, N: tl.constexpr, C: tl.constexpr,
    BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, SW: tl.constexpr, CH: tl.constexpr,
    ROUNDS_M: tl.constexpr, ROUNDS_R: tl.constexpr, ROUNDS_MATCH: tl.constexpr, ROUNDS_N: tl.constexpr,
    HAS_NUM_KEEP: tl.constexpr, HAS_DEPTH_LIMIT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    ws_f = ws_f_ptr + b * SW
    ws_i = ws_i_ptr + b * SW
    ws_m = ws_m_ptr + b * (BR + 1) * (BN + 1)

    m, mok, p_tok, p_par, keep, num_draft = _prune(
        pool_tok_ptr, pool_par_ptr, pool_sc_ptr, pool_dep_ptr, ckpt_ptr, thr_ptr, keep_table_ptr, num_keep_ptr,
        depth_limit_ptr, keep_ptr, stage_ptr, conf_ptr, num_kept_ptr, ws_f, ws_i, b,
        M, N, C, BM, CH, ROUNDS_M, HAS_NUM_KEEP, HAS_DEPTH_LIMIT)
    s, sok, row = _place_draft(root_ptr, tokens_ptr, parents_ptr, from_draft_ptr, from_ret_ptr, draft_index_ptr,
                               ret_index_ptr, ws_i, b, m, mok, p_tok, p_par, keep, pad_token_id, M, N, BM, BN)
    _graft_retrieved(r_tok_ptr, r_par_ptr, r_sc_ptr, r_valid_ptr, tokens_ptr, parents_ptr, from_draft_ptr,
                     from_ret_ptr, ret_index_ptr, ret_slot_ptr, num_retrieved_ptr, num_merged_ptr, ws_f, ws_i, ws_m,
                     b, num_draft, R, N, BR, BN, ROUNDS_R, ROUNDS_MATCH)

    # ----------------------------------------------------------------------------- 3. flatten
    parent = tl.load(parents_ptr + row, mask=sok, other=-1)
    linked = ((tl.load(from_draft_ptr + row, mask=sok, other=0) | tl.load(from_ret_ptr + row, mask=sok, other=0))
              != 0) & sok
    tl.store(linked_ptr + row, linked.to(tl.int8), mask=sok)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    _layout_rows(parent, linked, seq_len, b, positions_ptr, depth_ptr, bits_ptr, mask_ptr, next_token_ptr,
                 next_sibling_ptr, flat_index_ptr, max_depth_ptr, N, BN, ROUNDS_N)


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(max(n, 1)))


def graft_step(
    pool_tokens: torch.Tensor,
    pool_parents: torch.Tensor,
    pool_scores: torch.Tensor,
    pool_depths: torch.Tensor,
    num_steps: int,
    root_tokens: torch.Tensor,
    r_tokens: torch.Tensor,
    r_parents: torch.Tensor,
    r_scores: torch.Tensor,
    r_valid: torch.Tensor,
    seq_lens: torch.Tensor,
    num_nodes: int,
    checkpoint_depths: torch.Tensor,
    thresholds: torch.Tensor,
    keep_table: torch.Tensor,
    pad_token_id: int = 0,
    num_keep: torch.Tensor | None = None,
    depth_limit: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Prune, graft (under the root) and flatten a batch in one launch; no host read.

    Args:
        pool_*: the draft pool ``[bs, M]`` (``M >= 1``), ``num_steps`` its depth.
        root_tokens: ``[bs]``; ``r_*``: retrieved trees ``[bs, R]``; ``seq_lens``: ``[bs]``.
        num_nodes: ``N <= 64``.
        checkpoint_depths / thresholds / keep_table: the prune config as device tensors
            (``C`` int64, ``C`` float32, ``C + 1`` int64).
        num_keep / depth_limit: ``[bs]`` overrides, as in ``prune_by_confidence``.

    Returns:
        Every tensor of ``PrunedDraft``, ``GraftTree`` and the verify layout, by field name.
    """
    bs, m = pool_tokens.shape
    r = r_tokens.shape[1]
    n = num_nodes
    c = checkpoint_depths.shape[0]
    if n > MAX_NODES or n < 1 or m < 1:
        raise ValueError(f"graft_step needs 1 <= N <= {MAX_NODES} and a non-empty pool, got N={n}, M={m}")
    dev = pool_tokens.device
    i64 = torch.int64
    out = {
        "keep": torch.empty((bs, m), dtype=torch.bool, device=dev),
        "stage": torch.empty(bs, dtype=i64, device=dev),
        "confidence": torch.empty((bs, c), dtype=torch.float32, device=dev),
        "num_kept": torch.empty(bs, dtype=i64, device=dev),
        "tokens": torch.empty((bs, n), dtype=i64, device=dev),
        "parents": torch.empty((bs, n), dtype=i64, device=dev),
        "from_draft": torch.empty((bs, n), dtype=torch.bool, device=dev),
        "from_retrieval": torch.empty((bs, n), dtype=torch.bool, device=dev),
        "linked": torch.empty((bs, n), dtype=torch.bool, device=dev),
        "draft_index": torch.empty((bs, n), dtype=i64, device=dev),
        "proposal_index": torch.empty((bs, n), dtype=i64, device=dev),
        "proposal_slot": torch.empty((bs, r), dtype=i64, device=dev),
        "num_retrieved": torch.empty(bs, dtype=i64, device=dev),
        "num_merged": torch.empty(bs, dtype=i64, device=dev),
        **layout_outputs(bs, n, dev),
    }
    if bs == 0:
        return out
    bm, br, bn = _pow2(m), _pow2(r), _pow2(n)
    sw = max(bm, br, bn) + 1
    ws_f = torch.empty((bs, sw), dtype=torch.float32, device=dev)
    ws_i = torch.empty((bs, sw), dtype=i64, device=dev)
    ws_m = torch.empty((bs, (br + 1) * (bn + 1)), dtype=torch.int8, device=dev)
    one = torch.zeros(1, dtype=i64, device=dev)
    if r == 0:  # keep every pointer valid
        r_tokens = r_parents = one
        r_scores, r_valid = one.float(), one.bool()
    longest = min(max(r, n - 1), num_steps)
    _graft_step_kernel[(bs,)](
        pool_tokens.contiguous(), pool_parents.contiguous(), pool_scores.float().contiguous(),
        pool_depths.contiguous(), root_tokens.contiguous(), seq_lens.contiguous(),
        r_tokens.contiguous(), r_parents.contiguous(), r_scores.float().contiguous(),
        r_valid.contiguous().view(torch.int8),
        checkpoint_depths if c else one, thresholds if c else one.float(), keep_table,
        num_keep if num_keep is not None else one, depth_limit if depth_limit is not None else one,
        out["keep"].view(torch.int8), out["stage"], out["confidence"] if c else one.float(), out["num_kept"],
        out["tokens"], out["parents"], out["from_draft"].view(torch.int8), out["from_retrieval"].view(torch.int8),
        out["linked"].view(torch.int8), out["draft_index"], out["proposal_index"], out["proposal_slot"] if r else one,
        out["num_retrieved"], out["num_merged"],
        *layout_args(out),
        ws_f, ws_i, ws_m,
        pad_token_id,
        M=m, R=r, N=n, C=c, BM=bm, BR=br, BN=bn, SW=sw, CH=min(bm, 64),
        ROUNDS_M=jump_rounds(m + 1), ROUNDS_R=jump_rounds(r + 1), ROUNDS_MATCH=jump_rounds(longest + 1),
        ROUNDS_N=jump_rounds(n),
        HAS_NUM_KEEP=num_keep is not None, HAS_DEPTH_LIMIT=depth_limit is not None,
        num_warps=4 if bm <= 128 else 8,
    )
    return out

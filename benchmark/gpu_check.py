"""GRAFT's Triton kernels against their torch references, on a GPU or under the Triton interpreter.

    python benchmark/gpu_check.py --out DIR [--phase checks|timings] [--parts NAME ...]
        # CUDA: up to ~2,000 cases per kernel (each stops after --case-seconds), sync-debug,
        # graph replay; timings
    TRITON_INTERPRET=1 python benchmark/gpu_check.py --interpret --out DIR   # CPU, small cases

Writes ``DIR/gpu_check.json`` after each check: ``{"kernels": {NAME: {"cases", "mismatches",
"first_mismatch", "truncated", "seconds"}}, "sync_debug": ..., "graph_replay": ..., "errors": ...}``
(sync_debug and graph_replay on CUDA only), and on CUDA ``DIR/gpu_timings.json``; exits 1 on any
mismatch or failed check. A case that raises is a mismatch, not the end of the run. Needs torch
and triton, not SGLang. On CUDA the checked step is the sync-free step's tree part: retrieved trees
re-rooted along a committed path on the device (``tree.reroot_proposals``, also compared with its
CPU run, ``reroot``), then prune -> graft -> flatten and the mask.

Cases: trees with N in {2, 16, 61, 64} (interpreter: {2, 5, 16}), bs in {1, 7, 48} (interpreter:
{1, 3}), of several shapes (random, chains, stars, forests, labels out of order, unlinked
padding and unlinked interior nodes) plus trees built by the GRAFT pipeline itself (draft +
retrieval with duplicates, ties and padding); recycling updates with many duplicate rows,
several scopes and padding rows.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("SGLANG_GRAFT_STANDALONE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "kernels"), str(ROOT / "benchmark")]

import torch  # noqa: E402

import sglang_graft_kernels as K  # noqa: E402
from sglang_graft.kernels import KERNELS_ENV  # noqa: E402
from sglang_graft.retrieval.recycling_matrix import RecyclingMatrix, scatter_last_wins  # noqa: E402
from sglang_graft.tree import (  # noqa: E402
    DraftPool,
    flatten,
    PruneConfig,
    RetrievalProposals,
    TreeMaskMode,
    ancestor_bits,
    build_graft_tree,
    encode_tree_mask,
    flatten_torch,
    reroot_proposals,
    warm_up_graft_kernels,
    write_tree_mask,
)
from sglang_graft.tree.pipeline import warm_up_depths  # noqa: E402
from tree_bench import capture, make_pool, make_proposals, timed, to_device  # noqa: E402

LAYOUT_FIELDS = ("positions", "depth", "ancestor_mask", "flat_index", "first_child",
                 "next_sibling", "max_depth")
CANARY = 7
CUDA = "cuda"  # the device of the CUDA checks (a dry run of this script's CUDA code points it at the CPU)


# ----------------------------------------------------------------------------------------- cases
def random_trees(bs: int, n: int, kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(parents [bs, n] int64, linked [bs, n] bool)`` of one shape family."""
    j = torch.arange(n)
    if kind == "chain":
        parents = (j - 1).expand(bs, n).clone()
    elif kind == "star":
        parents = torch.where(j == 0, -1, 0).expand(bs, n).clone()
    else:
        parents = (torch.rand(bs, n, generator=gen) * j).long()  # uniform in [0, j)
        parents[:, 0] = -1
    if kind == "forest":  # several roots
        parents = torch.where(torch.rand(bs, n, generator=gen) < 0.2, -1, parents)
    linked = parents >= 0
    if kind == "padded":  # SGLang-style padding: a tail of unlinked nodes under the root
        tail = j >= n - torch.randint(0, n, (bs, 1), generator=gen)
        parents = torch.where(tail & (j > 0), 0, parents)
        linked = linked & ~tail
    if kind == "unlinked":  # unlinked interior nodes (their subtrees become unreachable)
        linked = linked & (torch.rand(bs, n, generator=gen) > 0.2)
    if kind == "permuted":  # parents need not precede children
        perm = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(n - 1, generator=gen) + 1]) if n > 1 else j
        inv = torch.empty_like(perm)
        inv[perm] = j
        parents = torch.where(parents[:, perm] >= 0, inv[parents[:, perm].clamp(min=0)], -1)
        linked = linked[:, perm]
    return parents, linked


def pipeline_trees(bs: int, n: int, gen: torch.Generator, device: str):
    """Trees of the GRAFT pipeline (draft + retrieval, duplicates, padding) and their seq_lens."""
    vocab = int(torch.randint(5, 60, (1,), generator=gen))  # small (duplicate tokens), > the pool topk 4
    pool = to_device(make_pool(bs, 4, 4, vocab, gen), device)
    proposals = to_device(make_proposals(bs, max(n - 1, 1), vocab, gen), device)
    roots = torch.randint(0, vocab, (bs,), generator=gen).to(device)
    seq_lens = torch.randint(0, 40, (bs,), generator=gen).to(device)
    keep = torch.randint(0, n, (bs,), generator=gen).to(device)
    step = build_graft_tree(pool, roots, proposals, seq_lens, n, PruneConfig(), num_keep=keep)
    return step.tree.parents, step.tree.linked, seq_lens


def tree_cases(sizes, batches, per_shape: int, device: str, gen: torch.Generator):
    kinds = ("random", "chain", "star", "forest", "padded", "unlinked", "permuted", "pipeline")
    for n in sizes:
        for bs in batches:
            for kind in kinds:
                for _ in range(per_shape):
                    if kind == "pipeline":
                        parents, linked, seq_lens = pipeline_trees(bs, n, gen, device)
                    else:
                        parents, linked = random_trees(bs, n, kind, gen)
                        seq_lens = torch.randint(0, 40, (bs,), generator=gen)
                    yield f"{kind} N={n} bs={bs}", parents.to(device), linked.to(device), seq_lens.to(device)


# ------------------------------------------------------------------------------------ checks
class Tally:
    """Cases and mismatches of one check. A case that raises counts as a mismatch (its exception is
    the detail: ``guard``); ``cases_of`` stops handing out cases once ``seconds`` have passed
    (``truncated``)."""

    def __init__(self, seconds: float | None = None) -> None:
        self.cases = 0
        self.mismatches = 0
        self.first = None
        self.seconds = seconds
        self.truncated = False
        self.elapsed = None

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.cases += 1
        if not ok:
            self.mismatches += 1
            self.first = self.first or f"{name}: {detail}"

    def cases_of(self, cases):
        """``cases`` until the time limit."""
        t0 = time.time()
        for case in cases:
            if self.seconds is not None and time.time() - t0 > self.seconds:
                self.truncated = True
                return
            yield case

    @contextlib.contextmanager
    def guard(self, name: str):
        try:
            yield
        except Exception as e:  # a kernel that raises (or a CUDA error) is a failed case, not the end
            self.check(name, False, f"raised {e!r}"[:400])

    def json(self) -> dict:
        return {"cases": self.cases, "mismatches": self.mismatches, "first_mismatch": self.first,
                "truncated": self.truncated, "seconds": self.elapsed}


def check_tree_kernels(cases, tallies: dict) -> None:
    for name, parents, linked, seq_lens in tallies["tree_layout"].cases_of(cases):
        with tallies["tree_layout"].guard(name):
            _check_tree_case(name, parents, linked, seq_lens, tallies)


def _check_tree_case(name, parents, linked, seq_lens, tallies: dict) -> None:
    ref = flatten_torch(None, parents, seq_lens, linked)
    got = K.tree_layout(parents, linked, seq_lens)
    bad = [f for f in LAYOUT_FIELDS if not torch.equal(got[f].cpu(), getattr(ref, f).cpu())]
    if not torch.equal(got["ancestor_bits"].cpu(), ancestor_bits(ref.ancestor_mask).cpu()):
        bad.append("ancestor_bits")
    tallies["tree_layout"].check(name, not bad, f"fields {bad}")

    bs, n = parents.shape
    total = int(seq_lens.sum()) * n + bs * n * n
    want = encode_tree_mask(ref.ancestor_mask, TreeMaskMode.FULL_MASK, seq_lens, int(seq_lens.sum()))
    buf = torch.full((total + 33,), CANARY, dtype=torch.uint8, device=parents.device)
    K.tree_mask(got["ancestor_bits"], seq_lens, 0, buf)
    ok = torch.equal(buf[:total].cpu(), want.to(torch.uint8).cpu()) and bool((buf[total:] == CANARY).all())
    tallies["tree_mask"].check(name + " FULL", ok, "FULL cells differ or canary overwritten")
    if n <= 32:
        want = encode_tree_mask(ref.ancestor_mask, TreeMaskMode.QLEN_ONLY_BITPACKING)
        storage = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[want.element_size()]
        buf = torch.full((bs * n + 5,), CANARY, dtype=storage, device=parents.device)
        K.tree_mask(got["ancestor_bits"], seq_lens, 2, buf)
        ok = torch.equal(buf[: bs * n].cpu(), want.view(storage).cpu()) and bool((buf[bs * n:] == CANARY).all())
        tallies["tree_mask"].check(name + " packed", ok, "packed rows differ or canary overwritten")


STEP_TREE_FIELDS = ("tokens", "parents", "linked", "from_draft", "from_retrieval", "draft_index", "proposal_index",
                    "proposal_slot", "num_draft", "num_retrieved", "num_merged", "anchor_slot")


def step_cases(sizes, batches, per_shape: int, device: str, gen: torch.Generator, few_widths: bool = False):
    """Inputs of ``build_graft_tree``: real draft pools, retrieval over a small vocabulary (merges
    with draft paths, duplicate siblings, invalid nodes), quantised scores (ties), optional
    cost-aware overrides (``num_keep``, ``depth_limit``). ``few_widths``: the proposal width R only
    0, N // 2 + 1 or 2N + 1 (Triton compiles ``graft_step`` once per (pool size, R, N, options): on
    CUDA random widths would spend the check compiling)."""
    shapes = ((1, 4), (2, 3), (4, 4), (8, 3))
    for c in range(per_shape * len(shapes)):  # every size early: a time-limited run still covers all
        for n in sizes:
            for bs in batches:
                topk, steps = shapes[c % len(shapes)]
                vocab = int(torch.randint(topk + 1, 40, (1,), generator=gen))
                pool = make_pool(bs, topk, steps, vocab, gen)
                if c % 3 == 0:  # ties
                    pool.scores = (pool.scores * 4).round() / 4
                r = int(torch.randint(0, 2 * n + 2, (1,), generator=gen))
                if few_widths:
                    r = (0, n // 2 + 1, 2 * n + 1)[(c // 4) % 3]
                proposals = make_proposals(bs, r, vocab, gen) if r else RetrievalProposals.empty(bs)
                if r and c % 4 == 1:
                    proposals.valid = torch.rand(bs, r, generator=gen) > 0.3
                if r and c % 3 == 2:
                    proposals.priority = (proposals.priority * 3).round() / 3
                thresholds = tuple(float(x) for x in torch.rand(3, generator=gen).mul(0.6))
                config = PruneConfig(checkpoint_depths=tuple(sorted({0, 1, steps - 1}))[:3], thresholds=thresholds[
                    : len(set((0, 1, steps - 1)))], keep_per_stage=(1, 3, 6)[: len(set((0, 1, steps - 1)))])
                roots = torch.randint(0, vocab, (bs,), generator=gen)
                seq_lens = torch.randint(0, 50, (bs,), generator=gen)
                num_keep = torch.randint(-1, n + 2, (bs,), generator=gen) if c % 2 else None
                depth_limit = torch.randint(0, steps, (bs,), generator=gen) if c % 4 == 3 else None
                yield (f"topk={topk} steps={steps} N={n} bs={bs} R={r} case={c}",
                       (pool, roots, proposals, seq_lens, n, config, "root", 0, num_keep, depth_limit))


def _on(args: tuple, device: str) -> tuple:
    return tuple(to_device(a, device) if isinstance(a, (DraftPool, RetrievalProposals))
                 else a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def check_graft_step(cases, tally: "Tally", device: str) -> None:
    """CPU (interpreter): the kernel called directly; CUDA: ``build_graft_tree``, which dispatches to it."""
    for name, args in tally.cases_of(cases):
        with tally.guard(name):
            ref = build_graft_tree(*args)  # CPU tensors: the torch pipeline
            dev_args = _on(args, device)
            if device == "cpu":
                bad = _dict_mismatches(ref, K.graft_step(*_kernel_args(dev_args)))
            else:
                bad = _step_mismatches(ref, build_graft_tree(*dev_args))
            tally.check(name, not bad, f"fields {bad}")


def _kernel_args(args: tuple) -> tuple:
    """``graft_step``'s arguments for ``build_graft_tree``'s (placement root)."""
    pool, roots, proposals, seq_lens, n, config, _, pad, num_keep, depth_limit = args
    return (pool.tokens, pool.parents, pool.scores, pool.depths, pool.num_steps, roots, proposals.tokens,
            proposals.parents, proposals.priority, proposals.valid, seq_lens, n,
            torch.tensor(config.checkpoint_depths, dtype=torch.int64), torch.tensor(config.thresholds),
            torch.tensor(config.keep_table(n), dtype=torch.int64), pad, num_keep, depth_limit)


def _dict_mismatches(ref, got: dict) -> list:
    bad = [f for f in ("keep", "stage", "confidence", "num_kept") if not torch.equal(got[f], getattr(ref.pruned, f))]
    bad += [f for f in STEP_TREE_FIELDS if f != "anchor_slot" and not torch.equal(
        got["num_kept" if f == "num_draft" else f], getattr(ref.tree, f))]
    bad += [f for f in LAYOUT_FIELDS if not torch.equal(got[f], getattr(ref.layout, f))]
    return bad


def _step_mismatches(ref, got) -> list:
    bad = [f for f in ("keep", "stage", "confidence", "num_kept")
           if not torch.equal(getattr(got.pruned, f).cpu(), getattr(ref.pruned, f))]
    bad += [f for f in STEP_TREE_FIELDS if not torch.equal(getattr(got.tree, f).cpu(), getattr(ref.tree, f))]
    bad += [f for f in LAYOUT_FIELDS if not torch.equal(getattr(got.layout, f).cpu(), getattr(ref.layout, f))]
    if not torch.equal(got.layout.draft_token.cpu(), ref.layout.draft_token):
        bad.append("draft_token")
    return bad


def check_dispatch(gen: torch.Generator, tally: "Tally") -> None:
    """The glue between the served ops and the kernels (what runs on CUDA), on the CPU: each
    dispatching op with the kernels forced on (``build_graft_tree`` with fixed and callable
    proposals, ``flatten``, ``write_tree_mask``, ``RecyclingMatrix.update``) against the same op on
    the torch references."""
    import contextlib
    import importlib

    modules = [importlib.import_module(f"sglang_graft.{m}")  # tree.flatten the module, not the function
               for m in ("tree.flatten", "tree.pipeline", "retrieval.recycling_matrix")]

    @contextlib.contextmanager
    def forced():
        saved = [(m, m.device_kernels) for m in modules]
        for m, _ in saved:
            m.device_kernels = lambda device: K
        try:
            yield
        finally:
            for m, f in saved:
                m.device_kernels = f

    for name, args in step_cases((2, 5, 16), (1, 3), 1, "cpu", gen):
        pool, roots, proposals, seq_lens, n = args[:5]
        ref = build_graft_tree(*args)
        ref_lay = flatten_torch(ref.tree.tokens, ref.tree.parents, seq_lens, ref.tree.linked)
        total = int(seq_lens.sum()) * n + roots.shape[0] * n * n
        want = encode_tree_mask(ref_lay.ancestor_mask, TreeMaskMode.FULL_MASK, seq_lens, int(seq_lens.sum()))
        calls = []
        with forced():
            got = build_graft_tree(*args)
            by_call = build_graft_tree(pool, roots, lambda a: calls.append(a) or proposals, *args[3:])
            lay = flatten(ref.tree.tokens, ref.tree.parents, seq_lens, ref.tree.linked)
            buf = torch.zeros(total, dtype=torch.bool)
            write_tree_mask(lay, seq_lens, TreeMaskMode.FULL_MASK, buf)
        bad = _step_mismatches(ref, got) + [f"callable:{f}" for f in _step_mismatches(ref, by_call)]
        bad += [f"flatten:{f}" for f in LAYOUT_FIELDS if not torch.equal(getattr(lay, f), getattr(ref_lay, f))]
        if got.layout.ancestor_bits is None or not torch.equal(buf, want):
            bad.append("write_tree_mask")
        if len(calls) != 1 or not torch.equal(calls[0], roots):
            bad.append("proposer called once with the roots")
        tally.check("dispatch " + name, not bad, f"fields {bad}")
    configs = {n: PruneConfig(checkpoint_depths=(0, 1), thresholds=(0.3, 0.2), keep_per_stage=(1, 2)) for n in (2, 8)}
    for topk, overrides, mode in ((2, True, 0), (1, False, 2), (4, True, 1)):
        with forced():
            shapes = warm_up_graft_kernels("cpu", topk, 3, 5, configs, overrides, mask_mode=mode)
        want = len(warm_up_depths(3, overrides)) * len(configs)  # the fixed budget (no overrides): one depth
        tally.check(f"warm-up topk={topk} mask={mode}", shapes == want, f"{shapes} shapes, {want} expected")
    for name, rm, rows, topk in recycle_cases(8, 200, "cpu", gen):
        tokens = torch.randint(0, rm.vocab_size, (rows.shape[0],), generator=gen)
        want = rm.successors.clone()
        rm.update(tokens, topk)
        want, got = rm.successors.clone(), want
        rm.successors.copy_(got)
        with forced():
            rm.update(tokens, topk)
        tally.check("dispatch recycle " + name, torch.equal(rm.successors, want), "tables differ")


def recycle_cases(count: int, max_nodes: int, device: str, gen: torch.Generator):
    for c in range(count):
        vocab = int(torch.randint(1, 80, (1,), generator=gen))
        k = (1, 2, 4, 8)[c % 4]
        scopes = 1 + c % 3
        n = int(torch.randint(0, max_nodes + 1, (1,), generator=gen))
        rm = RecyclingMatrix(vocab, k=k, widths=(1,), device=device, num_scopes=scopes)
        rm.successors.copy_(torch.randint(0, vocab + 1, rm.successors.shape, generator=gen).to(device))
        tokens = torch.randint(0, vocab, (n,), generator=gen).to(device)
        scope = torch.randint(0, scopes, (n,), generator=gen).to(device)
        valid = (torch.rand(n, generator=gen) > 0.2).to(device)
        topk = torch.randint(0, vocab, (n, k), generator=gen).to(device)
        yield f"n={n} vocab={vocab} k={k} scopes={scopes}", rm, rm.row_index(tokens, scope, valid), topk


def check_recycle(cases, tally: Tally) -> None:
    for name, rm, rows, topk in tally.cases_of(cases):
        with tally.guard(name):
            want = rm.successors.clone()
            scatter_last_wins(want, rows, topk)
            got = rm.successors.clone()
            K.recycle_scatter(got, rows, topk)
            tally.check(name, torch.equal(got.cpu(), want.cpu()), "tables differ")


# ------------------------------------------------------------------------- CUDA-only checks
PATH_WIDTH = 8  # committed path of the newest step (the sync-free step re-roots along it)


def reroot_inputs(bs: int, r: int, gen: torch.Generator, vocab: int = 6):
    """Retrieved trees over a small alphabet and paths that often follow them (a root path of a
    random node, cut at a random length), sometimes not."""
    props = make_proposals(bs, r, vocab, gen)
    node = torch.randint(0, max(r, 1), (bs,), generator=gen)
    path = torch.randint(0, vocab, (bs, PATH_WIDTH), generator=gen)
    length = torch.ones(bs, dtype=torch.int64)
    for b in range(bs):
        chain, v = [], int(node[b]) if r else -1
        while v >= 0 and len(chain) < PATH_WIDTH:
            chain.append(int(props.tokens[b, v]))
            v = int(props.parents[b, v])
        chain.reverse()
        if chain and torch.rand(1, generator=gen).item() < 0.8:
            cut = int(torch.randint(1, len(chain) + 1, (1,), generator=gen))
            path[b, :cut] = torch.tensor(chain[:cut])
            length[b] = cut
        else:
            length[b] = int(torch.randint(1, PATH_WIDTH + 1, (1,), generator=gen))
    return props, path, length


def check_reroot(count: int, tally: "Tally", gen: torch.Generator) -> None:
    """The re-root op on CUDA against its CPU run (torch on both; the op must not depend on the device)."""
    for i in tally.cases_of(range(count)):
        bs, r = [(1, 8), (7, 30), (48, 75), (3, 0)][i % 4]
        width = (0, 15, 60, r + 4)[(i // 4) % 4]
        name = f"reroot bs={bs} R={r} width={width}"
        with tally.guard(name):
            props, path, length = reroot_inputs(bs, r, gen)
            want, want_m = reroot_proposals(props, path, length, width)
            got, got_m = reroot_proposals(to_device(props, CUDA), path.to(CUDA), length.to(CUDA), width)
            fields = ("tokens", "parents", "priority", "valid")
            same = torch.equal(want_m, got_m.cpu()) and all(
                torch.equal(getattr(want, f), getattr(got, f).cpu()) for f in fields)
            tally.check(name, same, "differs from the CPU run")


def step_inputs(bs: int, n: int, gen: torch.Generator):
    pool = to_device(make_pool(bs, 8, 6, 32000, gen), CUDA)
    proposals, path, length = (to_device(x, CUDA) if isinstance(x, RetrievalProposals) else x.to(CUDA)
                               for x in reroot_inputs(bs, n - 1 + PATH_WIDTH, gen, vocab=32000))
    roots = torch.randint(0, 32000, (bs,), generator=gen).to(CUDA)
    seq_lens = torch.randint(100, 2000, (bs,), generator=gen).to(CUDA)
    buf = torch.ones(int(seq_lens.sum()) * n + bs * n * n, dtype=torch.bool, device=CUDA)
    return pool, (proposals, path, length), roots, seq_lens, buf


def tree_step(pool, retrieved, roots, seq_lens, buf, n):
    """The tree part of a sync-free GRAFT step: retrieved trees re-rooted along the newest committed
    path, prune -> graft -> flatten, and the FULL mask into a buffer."""
    proposals, _ = reroot_proposals(*retrieved, n - 1)
    step = build_graft_tree(pool, roots, proposals, seq_lens, n, PruneConfig())
    write_tree_mask(step.layout, seq_lens, TreeMaskMode.FULL_MASK, buf)
    return step


def capture_checks(result: dict, gen: torch.Generator) -> bool:
    """Sync-debug mode over the eager and the captured tree step; replay against eager."""
    n, bs = 61, 48
    inputs = step_inputs(bs, n, gen)
    tree_step(*inputs, n)  # compile the kernels outside the checks
    graph, out = capture(lambda: tree_step(*inputs, n))  # capture synchronizes: outside the debug mode
    ok = True
    try:
        torch.cuda.set_sync_debug_mode("error")
        tree_step(*inputs, n)
        graph.replay()
        result["sync_debug"] = {"mode": "error", "ok": True,
                                "scope": "tree step (re-root + kernels + mask), eager and replay"}
    except Exception as e:  # a sync inside the step
        result["sync_debug"] = {"mode": "error", "ok": False, "error": repr(e)[:500]}
        ok = False
    finally:
        torch.cuda.set_sync_debug_mode(0)
    eager = tree_step(*inputs, n)
    mask_eager = inputs[4].clone()
    inputs[4].fill_(False)
    graph.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(getattr(eager.layout, f), getattr(out.layout, f)) for f in LAYOUT_FIELDS)
    same = same and torch.equal(eager.tree.tokens, out.tree.tokens) and torch.equal(mask_eager, inputs[4])
    result["graph_replay"] = {"equal_to_eager": bool(same), "bs": bs, "N": n}
    return ok and same


def timings(gen: torch.Generator) -> list[dict]:
    """Median microseconds (CUDA events) of the tree step's parts at bs 1 / 16 / 64, N 16 / 61."""
    rows = []
    for n in (16, 61):
        for bs in (1, 16, 64):
            pool, retrieved, roots, seq_lens, buf = step_inputs(bs, n, gen)
            proposals, _ = reroot_proposals(*retrieved, n - 1)
            parents = build_graft_tree(pool, roots, proposals, seq_lens, n, PruneConfig()).tree
            row = {"bs": bs, "N": n}
            row["layout_kernel_us"] = 1e3 * timed(
                lambda: K.tree_mask(K.tree_layout(parents.parents, parents.linked, seq_lens)["ancestor_bits"],
                                    seq_lens, 0, buf), CUDA, 10, 50)
            seq_sum = int(seq_lens.sum())

            def torch_layout():
                layout = flatten_torch(None, parents.parents, seq_lens, parents.linked)
                return encode_tree_mask(layout.ancestor_mask, TreeMaskMode.FULL_MASK, seq_lens, seq_sum)

            row["layout_torch_us"] = 1e3 * timed(torch_layout, CUDA, 10, 50)
            row["reroot_us"] = 1e3 * timed(lambda: reroot_proposals(*retrieved, n - 1), CUDA, 10, 50)
            step = lambda: tree_step(pool, retrieved, roots, seq_lens, buf, n)  # noqa: E731
            row["tree_step_eager_us"] = 1e3 * timed(step, CUDA, 10, 50)
            os.environ[KERNELS_ENV] = "torch"
            row["tree_step_eager_torch_us"] = 1e3 * timed(step, CUDA, 10, 50)
            os.environ[KERNELS_ENV] = "triton"
            graph, _ = capture(step)
            row["tree_step_graph_us"] = 1e3 * timed(graph.replay, CUDA, 10, 50)
            rows.append(row)
    return rows


def run_checks(args, device: str, gen: torch.Generator, result: dict, save) -> bool:
    """The kernels against their references (each CUDA check stops after ``args.case_seconds``),
    then, on CUDA, the re-root op and the captured step. ``save()`` after each part."""
    tallies = result["kernels"] = {}
    interp = args.interpret
    sizes, batches = ((2, 5, 16), (1, 3)) if interp else ((2, 16, 61, 64), (1, 7, 48))
    limit = None if interp else args.case_seconds
    parts = [
        ("tree_layout", lambda t: check_tree_kernels(tree_cases(sizes, batches, 4 if interp else 32, device, gen),
                                                     {"tree_layout": t, "tree_mask": tally("tree_mask")})),
        ("recycle_scatter", lambda t: check_recycle(recycle_cases(60 if interp else 2000, 300 if interp else 3000,
                                                                  device, gen), t)),
        ("graft_step", lambda t: check_graft_step(
            step_cases(sizes, batches, 3 if interp else 42, device, gen, few_widths=not interp), t, device)),
        ("dispatch" if interp else "reroot",
         (lambda t: check_dispatch(gen, t)) if interp else (lambda t: check_reroot(2000, t, gen))),
    ]
    kept: dict[str, Tally] = {}

    def tally(name: str) -> Tally:
        return kept.setdefault(name, Tally(limit))

    ok = True
    for name, part in parts:
        if args.parts and name not in args.parts:
            continue
        t0 = time.time()
        try:
            part(tally(name))
        except Exception:
            result.setdefault("errors", {})[name] = traceback.format_exc()[-3000:]
            ok = False
        kept[name].elapsed = round(time.time() - t0, 1)
        tallies.update({k: t.json() for k, t in kept.items()})
        save()
    if not interp and (not args.parts or "capture" in args.parts):
        try:
            ok = capture_checks(result, gen) and ok
        except Exception:
            result.setdefault("errors", {})["capture"] = traceback.format_exc()[-3000:]
            ok = False
    return ok and all(t.mismatches == 0 and t.cases > 0 for t in kept.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for gpu_check.json (and gpu_timings.json)")
    parser.add_argument("--interpret", action="store_true", help="CPU, Triton interpreter, small cases")
    parser.add_argument("--phase", choices=("checks", "timings", "all"), default="all",
                        help="CUDA: the checks (gpu_check.json), the timings (gpu_timings.json) or both")
    parser.add_argument("--case-seconds", type=float, default=60.0,
                        help="CUDA: stop each kernel's cases after this many seconds (reported as truncated)")
    parser.add_argument("--parts", nargs="*", default=None,
                        help="only these checks (tree_layout recycle_scatter graft_step reroot capture dispatch)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.interpret and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--interpret needs TRITON_INTERPRET=1 in the environment (set before Triton loads)")
    if not args.interpret and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --interpret under TRITON_INTERPRET=1")
    if os.environ.get("GPU_CHECK_TRACEBACK_AFTER"):  # where a run stands before its timeout kills it
        faulthandler.dump_traceback_later(float(os.environ["GPU_CHECK_TRACEBACK_AFTER"]), exit=False)
    device = "cpu" if args.interpret else CUDA
    gen = torch.Generator().manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = {"device": "triton-interpreter (cpu)" if args.interpret else torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": __import__("triton").__version__, "interpret": args.interpret}
    ok = True
    if args.interpret or args.phase in ("checks", "all"):
        t0 = time.time()
        result = dict(head)

        def save() -> None:
            result["seconds"] = round(time.time() - t0, 1)
            (out / "gpu_check.json").write_text(json.dumps(result, indent=2))

        result["ok"] = ok = run_checks(args, device, gen, result, save)
        save()
        print(json.dumps(result, indent=2))
    if not args.interpret and args.phase in ("timings", "all"):
        timing = dict(head)
        try:
            timing["timings"] = timings(gen)
        except Exception:
            timing["error"] = traceback.format_exc()[-3000:]
            ok = False
        (out / "gpu_timings.json").write_text(json.dumps(timing, indent=2))
        print(json.dumps(timing, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

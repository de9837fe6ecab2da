"""The prune -> graft -> flatten path is CUDA-graph friendly: fixed shapes, no host sync.

Checked on CPU two ways: the whole path runs on the ``meta`` device (any read of a tensor
value, ``.item()``, ``.tolist()``, ``bool(t)`` or a data-dependent shape fails there) and
produces the shapes of a real run; and a dispatch-mode guard sees no host-syncing or
data-dependent-shape operator. On CUDA the path is captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import pytest
import torch
from test_tree_support import DEVICES, random_proposals, simulate_eagle_draft

from sglang_graft.tree import (
    DraftPool,
    PruneConfig,
    RetrievalProposals,
    build_graft_tree,
    draft_pool_from_sglang,
    verify_tree_greedy,
    verify_tree_sampling,
)
from sglang_graft.tree.flatten import full_tree_mask
from sglang_graft.tree.guards import HostSyncError, forbid_host_sync

BS, TOPK, STEPS, N, R, VOCAB = 3, 4, 6, 60, 52, 40
CONFIG = PruneConfig(thresholds=(0.3, 0.2, 0.05))


def _inputs(seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    s, t, p = simulate_eagle_draft(BS, TOPK, STEPS, VOCAB, gen)
    pool = draft_pool_from_sglang(s, t, p, TOPK, STEPS)
    props = random_proposals(BS, R, VOCAB, gen, pool=pool)
    roots = torch.randint(0, VOCAB, (BS,), generator=gen)
    seq_lens = torch.randint(1, 50, (BS,), generator=gen)
    move = lambda x: x.to(device)  # noqa: E731
    pool = DraftPool(move(pool.tokens), move(pool.parents), move(pool.scores), move(pool.depths), TOPK, STEPS)
    props = RetrievalProposals(move(props.tokens), move(props.parents), move(props.priority), move(props.valid))
    return pool, move(roots), props, move(seq_lens)


def _tensors(obj, prefix=""):
    """All tensors reachable from a dataclass tree, by dotted name."""
    out = {}
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            out[prefix + name] = value
        elif hasattr(value, "__dataclass_fields__"):
            out.update(_tensors(value, prefix + name + "."))
    return out


def test_pipeline_runs_on_meta_with_the_shapes_of_a_real_run():
    real = _tensors(build_graft_tree(*_inputs(0), N, CONFIG))
    meta_in = _inputs(0, "meta")
    meta = _tensors(build_graft_tree(*meta_in, N, CONFIG))
    assert real.keys() == meta.keys() and len(real) > 20
    for name in real:
        assert meta[name].device.type == "meta", name
        assert meta[name].shape == real[name].shape and meta[name].dtype == real[name].dtype, name
    # Shapes depend only on (bs, M, R, N): another draw of the data gives the same shapes.
    other = _tensors(build_graft_tree(*_inputs(1), N, CONFIG))
    assert {k: v.shape for k, v in other.items()} == {k: v.shape for k, v in real.items()}


@pytest.mark.parametrize("placement", ["root", "deepest_draft"])
def test_pipeline_and_verify_do_not_sync(placement):
    pool, roots, props, seq_lens = _inputs(2)
    seq_sum = int(seq_lens.sum())
    gen = torch.Generator().manual_seed(0)
    target = torch.randint(0, VOCAB, (BS, N), generator=gen)
    probs = torch.softmax(torch.randn(BS, N, VOCAB, generator=gen), -1)
    coins, final = torch.rand(BS, N, generator=gen), torch.rand(BS, generator=gen)
    with forbid_host_sync() as ops:
        step = build_graft_tree(pool, roots, props, seq_lens, N, CONFIG, placement)
        lay = step.layout
        full_tree_mask(lay.ancestor_mask, seq_lens, seq_sum)
        links = (step.tree.tokens, lay.flat_index, lay.first_child, lay.next_sibling)
        verify_tree_greedy(*links, target, N)
        verify_tree_sampling(*links, probs, coins, final, N)
    assert "scatter_" in ops and "gather" in ops  # the guard did see the work


def test_the_guard_catches_host_syncs():
    x = torch.arange(5)
    for bad in (lambda: x.sum().item(), lambda: bool(x.any()), lambda: torch.nonzero(x), lambda: x[x > 2],
                lambda: torch.tensor([1, 2])):
        with pytest.raises(HostSyncError):
            with forbid_host_sync():
                bad()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("placement", ["root", "deepest_draft"])
def test_pipeline_replays_in_a_cuda_graph(placement):
    static = _inputs(3, "cuda")
    pool, roots, props, seq_lens = static

    def run():
        return _tensors(build_graft_tree(pool, roots, props, seq_lens, N, CONFIG, placement))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (4, 5):
        fresh = _inputs(seed, "cuda")
        for dst, src in zip(
            (pool.tokens, pool.parents, pool.scores, roots, props.tokens, props.parents, props.priority, props.valid,
             seq_lens),
            (fresh[0].tokens, fresh[0].parents, fresh[0].scores, fresh[1], fresh[2].tokens, fresh[2].parents,
             fresh[2].priority, fresh[2].valid, fresh[3]),
        ):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = _tensors(build_graft_tree(*_inputs(seed, "cuda"), N, CONFIG, placement))
        for name, value in eager.items():
            assert torch.equal(out[name], value), name


@pytest.mark.parametrize("device", DEVICES)
def test_pipeline_is_deterministic(device):
    a = _tensors(build_graft_tree(*_inputs(6, device), N, CONFIG))
    b = _tensors(build_graft_tree(*_inputs(6, device), N, CONFIG))
    for name in a:
        assert torch.equal(a[name], b[name]), name

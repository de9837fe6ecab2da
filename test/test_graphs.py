"""``sglang_graft.graphs``: capture / replay with CUDA-graph semantics, on a CPU (the stand-in) and on CUDA.

The step captured is GRAFT's real draft + tree step: a toy draft model (embedding -> mixed hidden
state -> logits, weights closed over) expanded per level as SGLang's ``select_top_k_tokens`` does,
``draft_pool_from_sglang``, then ``build_graft_tree`` with the retrieval proposals, the hidden state,
root tokens, committed lengths and depth limits as static inputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_graft.graphs import GraphCache, GraphCaptureError, capture
from sglang_graft.tree import HostReadCounter, PruneConfig, RetrievalProposals, build_graft_tree, draft_pool_from_sglang

VOCAB, HIDDEN, TOPK, WIDTH = 32, 16, 4, 8
_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not _CUDA, reason="needs CUDA")


def _tensors(obj) -> list:
    """Every tensor of a tensor / tuple / list / dataclass tree, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


def assert_replay_equals_eager(graph, fn, inputs) -> None:
    """Replay ``graph`` and run ``fn(*inputs)`` eagerly: every output must be equal (``torch.equal``)."""
    got, want = _tensors(graph.replay()), _tensors(fn(*inputs))
    assert len(got) == len(want) > 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        assert torch.equal(g, w), f"output {i} of graph {graph.name!r}: replay != eager"


def _select_top_k(i: int, topk_p, topk_index, hidden, scores, bs: int):
    """SGLang's ``select_top_k_tokens`` (eagle_utils.py), restated: next inputs and tree info."""
    if i == 0:
        parents = torch.arange(-1, TOPK, device=hidden.device).unsqueeze(0).repeat(bs, 1)
        return (topk_index.flatten(), hidden.repeat_interleave(TOPK, dim=0), topk_p,
                (topk_p.unsqueeze(1), topk_index, parents))
    expand = scores.unsqueeze(2) * topk_p.reshape(-1, TOPK, TOPK)
    cs_p, cs_index = torch.topk(expand.flatten(start_dim=1), TOPK, dim=-1)
    tokens = topk_index.reshape(-1, TOPK * TOPK)
    ids = torch.gather(tokens, 1, cs_index).flatten()
    rows = cs_index.flatten() // TOPK + torch.arange(0, hidden.shape[0], step=TOPK,
                                                     device=hidden.device).repeat_interleave(TOPK)
    return ids, hidden[rows, :], cs_p, (expand, tokens, cs_index + (TOPK * TOPK * (i - 1) + TOPK))


def make_step(bs: int, depth: int, n: int, device: str = "cpu", seed: int = 0):
    """(fn, static inputs, refill) of the draft + tree step for batch ``bs``, draft depth, budget ``N``."""
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(VOCAB, HIDDEN, generator=gen).to(device)
    mix = (torch.randn(HIDDEN, HIDDEN, generator=gen) * 0.5).to(device)
    head = (torch.randn(HIDDEN, VOCAB, generator=gen) * 2.0).to(device)
    checkpoints = tuple(d for d in (0, 1, 5) if d < depth)
    keep = tuple(round(f * (n - 1)) for f in (8 / 60, 24 / 60, 40 / 60))[: len(checkpoints)]
    config = PruneConfig(checkpoints, (0.35, 0.25, 0.15)[: len(checkpoints)], keep)

    def step(root, hidden, seq_lens, p_tokens, p_parents, p_priority, p_valid, depth_limit):
        ids, h, scores, lists = root, hidden, None, ([], [], [])
        for i in range(depth):
            h = torch.tanh(emb[ids] + h @ mix)
            topk_p, topk_index = torch.topk(torch.softmax(h @ head, dim=-1), TOPK, dim=-1)
            ids, h, scores, info = _select_top_k(i, topk_p, topk_index, h, scores, bs)
            for out, item in zip(lists, info):
                out.append(item)
        pool = draft_pool_from_sglang(*lists, TOPK, depth)
        proposals = RetrievalProposals(p_tokens, p_parents, p_priority, p_valid)
        return pool, build_graft_tree(pool, root, proposals, seq_lens, n, config, depth_limit=depth_limit)

    def fresh():
        r = torch.arange(WIDTH)
        temperature = torch.rand((), generator=gen) * 3 + 0.2  # confident and unsure drafts
        return [torch.randint(0, VOCAB, (bs,), generator=gen), torch.randn(bs, HIDDEN, generator=gen) * temperature,
                torch.randint(1, 100, (bs,), generator=gen), torch.randint(0, VOCAB, (bs, WIDTH), generator=gen),
                (torch.rand(bs, WIDTH, generator=gen) * (r + 1)).long() - 1, torch.rand(bs, WIDTH, generator=gen),
                torch.rand(bs, WIDTH, generator=gen) > 0.2, torch.randint(0, depth, (bs,), generator=gen)]

    inputs = [t.to(device) for t in fresh()]

    def refill():
        for dst, src in zip(inputs, fresh()):
            dst.copy_(src)

    return step, inputs, refill


# (bs, depth, N): 24 graphs.
GRID = [(bs, depth, n) for bs in (1, 3) for depth in (1, 3, 6) for n in (1, 4, 8, 16)]


@pytest.mark.parametrize("bs,depth,n", GRID)
def test_replay_equals_eager_for_the_draft_and_tree_step(bs, depth, n):
    fn, inputs, refill = make_step(bs, depth, n, seed=bs * 100 + depth * 10 + n)
    graph = capture(fn, inputs, name=f"step-{bs}-{depth}-{n}")
    assert graph.backend == "standin" and graph.nodes > 100 and graph.bytes > 0
    pool, step = graph.outputs
    assert step.layout.draft_token.shape == (bs * n,) and pool.tokens.shape[0] == bs
    for _ in range(4):
        refill()
        assert_replay_equals_eager(graph, fn, inputs)
    assert graph.replays == 4


def test_replays_cover_several_pruning_stages():
    fn, inputs, refill = make_step(3, 6, 16)
    graph = capture(fn, inputs)
    stages = set()
    for _ in range(6):
        refill()
        assert_replay_equals_eager(graph, fn, inputs)
        stages.update(graph.outputs[1].pruned.stage.tolist())
    assert len(stages) >= 3, stages


def test_a_data_dependent_branch_is_refused_at_capture():
    def branch(x):
        if x.max() > 0.5:
            return x * 2
        return x

    with pytest.raises(GraphCaptureError, match=r"'branch'.*__bool__\(\) at \S*test_graphs:\d+"):
        capture(branch, [torch.rand(3, 4)])

    def fill(x):  # the read is inside a C++ op: the host-read guard cannot see it, make_fx refuses it
        return x + torch.full((3, 4), x.max())

    with pytest.raises(GraphCaptureError, match=r"'fill'.*data-dependent.*_local_scalar_dense"):
        capture(fill, [torch.rand(3, 4)])


def test_a_rebound_static_input_is_caught_by_replay_vs_eager():
    fn, inputs, refill = make_step(3, 3, 8)
    graph = capture(fn, inputs)
    refill()
    assert_replay_equals_eager(graph, fn, inputs)
    inputs = list(inputs)
    inputs[1] = torch.randn(3, HIDDEN) * 3  # re-bound, not copy_-ed: the graph still reads the old one
    with pytest.raises(AssertionError, match="replay != eager"):
        assert_replay_equals_eager(graph, fn, inputs)


def test_an_output_held_across_replays_is_overwritten():
    fn, inputs, refill = make_step(3, 3, 8)
    graph = capture(fn, inputs)
    held = graph.outputs[0].scores
    before = held.clone()
    refill()
    pool, _ = graph.replay()
    assert pool.scores is held and not torch.equal(held, before)
    assert torch.equal(held, fn(*inputs)[0].scores)


def test_closed_over_tensors_are_bound_by_identity():
    weight = torch.randn(4, 4)
    graph = capture(lambda x: x @ weight, [torch.randn(2, 4)])
    weight.mul_(-2.0)  # an in-place update (a KV cache write) is seen by the next replay
    assert torch.equal(graph.replay(), graph.static_inputs[0] @ weight)


def test_dict_and_namedtuple_outputs_keep_their_structure():
    from collections import namedtuple

    Pair = namedtuple("Pair", "doubled shifted")
    graph = capture(lambda x: {"pair": Pair(x * 2, x + 1), "n": 3}, [torch.randn(2, 3)])
    out = graph.outputs
    assert isinstance(out["pair"], Pair) and out["n"] == 3
    graph.static_inputs[0].copy_(torch.ones(2, 3))
    assert graph.replay() is out and torch.equal(out["pair"].doubled, torch.full((2, 3), 2.0))


def _partial(x):
    """Writes only part of its outputs; ``untouched`` not at all."""
    out = torch.empty(x.shape[0], 4)
    out[:, :2] = x[:, :2] * 2
    ints = torch.empty(x.shape[0], 3, dtype=torch.int64)
    ints[:, 0] = x[:, 0].long()
    flags = torch.empty(x.shape[0], 2, dtype=torch.bool)
    flags[:, 0] = x[:, 0] > 0
    return out, ints, flags, torch.empty(x.shape[0], 2, dtype=torch.uint8)


def test_poison_shows_what_a_replay_does_not_write():
    x = torch.randn(3, 4)
    stale = capture(_partial, [x])
    stale.outputs[0].fill_(7.0)  # whatever the graph's memory held before
    x.copy_(torch.randn(3, 4))
    out, _, _, _ = stale.replay()
    assert (out[:, 2:] == 7.0).all()  # without poison the missed writes read stale memory
    graph = capture(_partial, [x], poison=True)
    out, ints, flags, untouched = graph.replay()
    assert out[:, 2:].isnan().all() and (ints[:, 1:] == -1).all() and flags[:, 1].all()
    assert (untouched == 255).all()
    assert torch.equal(out[:, :2], x[:, :2] * 2) and torch.equal(ints[:, 0], x[:, 0].long())


def test_poison_leaves_a_correct_graph_equal_to_eager():
    fn, inputs, refill = make_step(3, 6, 16)
    graph = capture(fn, inputs, poison=True)
    for _ in range(3):
        refill()
        assert_replay_equals_eager(graph, fn, inputs)


def test_a_host_read_fails_at_warm_up_naming_the_site():
    def reads(x):
        return x + torch.tensor(x.tolist())

    with pytest.raises(GraphCaptureError, match=r"'reads': 2 host read\(s\).*tolist\(\) at \S*test_graphs:\d+"):
        capture(reads, [torch.rand(3)])


def test_replay_makes_no_host_read():
    fn, inputs, refill = make_step(3, 6, 16)
    graph = capture(fn, inputs, poison=True)
    refill()
    with HostReadCounter() as reads:
        graph.replay()
    assert reads.total("sglang_graft") == 0 and sum(reads.counts.values()) == 0, dict(reads.sites)


def test_graph_cache_captures_once_per_key_and_counts_replays():
    cache = GraphCache(backend="standin")
    assert cache.stats() == {"mode": "standin", "captured": 0, "replays": 0}
    built = []

    def factories(key):
        fn, inputs, _ = make_step(*key)
        return (lambda: built.append(key) or fn), (lambda: inputs)

    for key in [(1, 1, 4), (3, 3, 8), (1, 1, 4), (1, 1, 4)]:
        cache.get_or_capture(key, *factories(key)).replay()
    assert built == [(1, 1, 4), (3, 3, 8)] and list(cache.graphs) == [(1, 1, 4), (3, 3, 8)]
    assert cache.stats() == {"mode": "standin", "captured": 2, "replays": 4}
    assert cache.graphs[(1, 1, 4)].replays == 3 and cache.graphs[(3, 3, 8)].replays == 1


def test_backend_choice():
    assert capture(lambda x: x + 1, [torch.zeros(2)]).backend == "standin"
    with pytest.raises(GraphCaptureError, match="CUDA device"):
        capture(lambda x: x + 1, [torch.zeros(2)], backend="cuda")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("bs,depth,n", [(1, 1, 4), (3, 3, 8), (3, 6, 16)]
                         # the served shapes: topk 4, 6 draft steps (pool 84), every default budget of N 16
                         + [(bs, 6, n) for bs in (1, 16) for n in (1, 4, 8, 16)])
def test_cuda_replay_equals_eager(bs, depth, n):
    fn, inputs, refill = make_step(bs, depth, n, device="cuda")
    graph = capture(fn, inputs, poison=True)
    assert graph.backend == "cuda" and graph.nodes is None
    for _ in range(4):
        refill()
        assert_replay_equals_eager(graph, fn, inputs)
    with HostReadCounter() as reads:
        graph.replay()
    assert sum(reads.counts.values()) == 0, dict(reads.sites)


@needs_cuda
@pytest.mark.gpu
def test_cuda_poison_and_held_outputs():
    x = torch.randn(3, 4, device="cuda")
    graph = capture(lambda x: (x * 2, torch.empty(3, 2, device=x.device)), [x], poison=True)
    doubled, untouched = graph.replay()
    assert untouched.isnan().all() and torch.equal(doubled, x * 2)
    x.copy_(torch.randn(3, 4, device="cuda"))
    assert graph.replay()[0] is doubled and torch.equal(doubled, x * 2)


# -- the stepper's tree build through captured graphs (engine.tree_graph) ----------------------------
def _tree_inputs(bs: int, depth: int, n: int, gen: torch.Generator):
    """A drafted pool (the toy draft above, run eagerly) and the tree build's other inputs."""
    fn, inputs, refill = make_step(bs, depth, n, seed=int(torch.randint(0, 10 ** 6, (), generator=gen)))
    pool, _ = fn(*inputs)
    root, _, seq_lens, p_tokens, p_parents, p_priority, p_valid, depth_limit = inputs
    num_keep = torch.randint(0, n, (bs,), generator=gen)
    return pool, root, RetrievalProposals(p_tokens, p_parents, p_priority, p_valid), seq_lens, num_keep, depth_limit


def test_tree_graphs_replay_the_stepper_build_exactly():
    """``--speculative-graft-graph shadow``: every build replayed from a graph keyed by budget and
    shapes and compared with the eager build; the same shapes replay, new ones capture."""
    from sglang_graft.engine.tree_graph import TreeGraphs

    graphs, gen = TreeGraphs("shadow", poison=True), torch.Generator().manual_seed(3)
    for bs, depth, n in [(1, 3, 4), (1, 3, 4), (2, 3, 8), (1, 3, 4), (2, 1, 8), (2, 3, 8)]:
        pool, root, props, lens, keep, limit = _tree_inputs(bs, depth, n, gen)
        config = PruneConfig((0, 1), (0.35, 0.25), (n - 1, n - 1))
        step = graphs(pool, root, props, lens, n, config, num_keep=keep, depth_limit=limit)
        want = build_graft_tree(pool, root, props, lens, n, config, num_keep=keep, depth_limit=limit)
        assert torch.equal(step.layout.draft_token, want.layout.draft_token)
        assert torch.equal(step.layout.ancestor_mask, want.layout.ancestor_mask)
    stats = graphs.stats()
    assert stats["captured"] == 3 and stats["replays"] == 6, stats
    assert stats["shadow_steps"] == 6 and stats["shadow_mismatches"] == 0, stats
    # a callable proposer is called on the root tokens before the graph
    pool, root, props, lens, keep, limit = _tree_inputs(1, 3, 4, gen)
    step = graphs(pool, root, lambda anchors: props, lens, 4, PruneConfig((0, 1), (0.35, 0.25), (3, 3)),
                  num_keep=keep, depth_limit=limit)
    assert graphs.stats()["replays"] == 7 and graphs.shadow_mismatches == 0
    with pytest.raises(ValueError, match="root"):
        graphs(pool, root, props, lens, 4, PruneConfig(), "deepest_draft")


def test_tree_graphs_pad_a_batch_to_its_bucket():
    """Batches of 3 and 4 share the graph of bucket 4, 5..8 that of 8 (a padded request repeats the
    last one, its rows are dropped): every replay equals the eager build of the real batch, what
    the graphs own poisoned before each replay."""
    from sglang_graft.engine.tree_graph import TreeGraphs

    graphs, gen = TreeGraphs("shadow", poison=True), torch.Generator().manual_seed(11)
    config = PruneConfig((0, 1), (0.35, 0.25), (7, 7))
    for bs in (3, 4, 3, 5, 8, 7):
        pool, root, props, lens, keep, limit = _tree_inputs(bs, 3, 8, gen)
        step = graphs(pool, root, props, lens, 8, config, num_keep=keep, depth_limit=limit)
        want = build_graft_tree(pool, root, props, lens, 8, config, num_keep=keep, depth_limit=limit)
        assert step.layout.draft_token.shape == want.layout.draft_token.shape == (bs * 8,)
        assert torch.equal(step.tree.tokens, want.tree.tokens)
    assert sorted(k[-1][0][0][0] for k in graphs.cache.graphs) == [4, 8]  # the buckets captured
    assert graphs.stats()["replays"] == 6 and graphs.shadow_mismatches == 0, graphs.stats()


@pytest.mark.parametrize("bs,bucket", [(1, 1), (2, 2), (3, 4), (5, 8), (12, 12), (13, 16), (25, 32), (33, 48)])
def test_batch_buckets_and_padding(bs, bucket):
    from sglang_graft.graphs import batch_bucket, pad_rows

    assert batch_bucket(bs) == bucket
    t = torch.arange(bs * 2 * 3).view(bs * 2, 3)  # two rows per request
    padded = pad_rows(t, bs, bucket)
    assert padded.shape == (bucket * 2, 3) and torch.equal(padded[: bs * 2], t)
    assert all(torch.equal(padded[2 * i: 2 * i + 2], t[-2:]) for i in range(bs, bucket))  # the last request
    slots = pad_rows(t[:, 0].contiguous(), bs, bucket, fill=0)
    assert torch.equal(slots[: bs * 2], t[:, 0]) and not slots[bs * 2:].any()


def test_tree_graphs_shadow_counts_a_mismatch():
    """The shadow check fails when the replay is stale: a graph whose static input is re-bound
    (the build's copy goes to a tensor the graph no longer reads)."""
    from sglang_graft.engine.tree_graph import TreeGraphs

    graphs, gen = TreeGraphs("shadow"), torch.Generator().manual_seed(5)
    config = PruneConfig((0, 1), (0.35, 0.25), (7, 7))
    first = _tree_inputs(2, 3, 8, gen)
    graphs(first[0], first[1], first[2], first[3], 8, config, num_keep=first[4], depth_limit=first[5])
    (graph,) = graphs.cache.graphs.values()
    graph.static_inputs = tuple(t.clone() for t in graph.static_inputs)  # copies now miss the graph
    for _ in range(4):
        pool, root, props, lens, keep, limit = _tree_inputs(2, 3, 8, gen)
        graphs(pool, root, props, lens, 8, config, num_keep=keep, depth_limit=limit)
    assert graphs.shadow_steps == 5 and graphs.shadow_mismatches >= 1


@needs_cuda
@pytest.mark.gpu
def test_cuda_tree_graphs_replay_the_stepper_build_exactly():
    """The served tree build (``--speculative-graft-graph on`` on CUDA): CUDA graphs of the Triton
    ``graft_step`` path, checked against eager builds (shadow) at the served shapes."""
    from sglang_graft.engine.tree_graph import TreeGraphs

    graphs, gen = TreeGraphs("shadow", backend="cuda", poison=True), torch.Generator().manual_seed(7)
    for bs, depth, n in [(1, 6, 4), (1, 6, 16), (16, 6, 8), (16, 3, 16), (1, 6, 4), (16, 6, 8)]:
        pool, root, props, lens, keep, limit = _tree_inputs(bs, depth, n, gen)
        to = lambda t: t.to("cuda")  # noqa: E731
        pool = dataclasses.replace(pool, tokens=to(pool.tokens), parents=to(pool.parents), scores=to(pool.scores),
                                   depths=to(pool.depths))
        props = RetrievalProposals(*(to(t) for t in (props.tokens, props.parents, props.priority, props.valid)))
        config = PruneConfig((0, 1, 5), (0.35, 0.25, 0.15), (n - 1,) * 3)
        graphs(pool, to(root), props, to(lens), n, config, num_keep=to(keep), depth_limit=to(limit))
    stats = graphs.stats()
    assert stats["mode"] == "cuda" and stats["captured"] == 4 and stats["replays"] == 6, stats
    assert stats["shadow_mismatches"] == 0, stats

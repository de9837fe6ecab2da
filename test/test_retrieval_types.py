"""RetrievedTree invariants and the padded batch format of stack_trees."""

import numpy as np
import pytest
import torch

from sglang_graft.retrieval import RetrievedTree, stack_trees


def tree(tokens, parents, scores):
    return RetrievedTree(
        tokens=np.array(tokens, dtype=np.int64),
        parents=np.array(parents, dtype=np.int64),
        scores=np.array(scores, dtype=np.float32),
    )


def test_empty_tree():
    empty = RetrievedTree.empty()
    assert len(empty) == 0
    assert empty.tokens.dtype == np.int64 and empty.parents.dtype == np.int64
    assert empty.scores.dtype == np.float32
    empty.validate()


def test_rejects_wrong_dtypes_and_lengths():
    with pytest.raises(ValueError):
        RetrievedTree(np.zeros(2, np.int32), np.zeros(2, np.int64), np.zeros(2, np.float32))
    with pytest.raises(ValueError):
        RetrievedTree(np.zeros(2, np.int64), np.zeros(3, np.int64), np.zeros(2, np.float32))
    with pytest.raises(ValueError):
        RetrievedTree(np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(2, np.float64))


@pytest.mark.parametrize(
    "tokens,parents,scores,reason",
    [
        ([1, 2], [-1, 1], [1.0, 0.5], "parent"),  # parent not before the node
        ([1, 1], [-1, -1], [1.0, 0.5], "sibling"),  # duplicate siblings
        ([1, 2], [-1, -1], [0.5, 1.0], "score"),  # siblings not by score
    ],
)
def test_validate_catches_broken_trees(tokens, parents, scores, reason):
    with pytest.raises(ValueError, match=reason):
        tree(tokens, parents, scores).validate()


def test_validate_accepts_a_tree_and_depths():
    t = tree([5, 6, 7, 5], [-1, 0, -1, 1], [1.0, 0.5, 0.5, 0.25])
    t.validate()
    assert t.depths().tolist() == [1, 2, 1, 3]


def test_stack_trees_pads_and_truncates():
    a = tree([5, 6, 7], [-1, 0, 1], [0.9, 0.8, 0.7])
    b = RetrievedTree.empty()
    c = tree([9], [-1], [1.0])
    tokens, parents, scores, valid = stack_trees([a, b, c], max_nodes=2)
    assert tokens.dtype == torch.int64 and parents.dtype == torch.int64
    assert scores.dtype == torch.float32 and valid.dtype == torch.bool
    assert tokens.tolist() == [[5, 6], [0, 0], [9, 0]]
    assert parents.tolist() == [[-1, 0], [-1, -1], [-1, -1]]
    assert valid.tolist() == [[True, True], [False, False], [True, False]]
    assert scores[0].tolist() == pytest.approx([0.9, 0.8])
    assert torch.isneginf(scores[1]).all() and torch.isneginf(scores[2, 1])
    assert scores[2, 0].item() == 1.0


def test_stack_trees_empty_batch_and_zero_width():
    tokens, parents, scores, valid = stack_trees([], max_nodes=4)
    assert tokens.shape == (0, 4) and valid.shape == (0, 4)
    tokens, _, _, valid = stack_trees([RetrievedTree.empty()], max_nodes=0)
    assert tokens.shape == (1, 0) and valid.shape == (1, 0)

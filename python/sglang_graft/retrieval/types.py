"""The proposal format shared by every retrieval source, and its padded batch form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

__all__ = ["RetrievedTree", "stack_trees"]


@dataclass(frozen=True)
class RetrievedTree:
    """Continuation candidates after the current context, as a small tree.

    tokens: int64 numpy [M]; parents: int64 numpy [M], index into the same arrays, -1 = child of
    the root (the root is the last token of the context, i.e. these are candidates for the
    next token); scores: float32 numpy [M], higher is better. Nodes are in topological order
    (parents[i] < i), siblings have distinct tokens, and children of a node are ordered by
    score descending (ties broken deterministically).

    Because the order is topological, every prefix ``[:m]`` of the arrays is itself a valid
    tree; ``stack_trees`` relies on this when it truncates.
    """

    tokens: np.ndarray
    parents: np.ndarray
    scores: np.ndarray

    def __post_init__(self) -> None:
        # Cheap checks only: this is built once per request per decode step. The full
        # structural check is `validate()`.
        m = self.tokens.shape[0]
        if (
            self.tokens.ndim != 1
            or self.parents.shape != (m,)
            or self.scores.shape != (m,)
            or self.tokens.dtype != np.int64
            or self.parents.dtype != np.int64
            or self.scores.dtype != np.float32
        ):
            raise ValueError(
                "RetrievedTree needs 1-D tokens int64, parents int64, scores float32 of one "
                f"length; got {self.tokens.dtype}{self.tokens.shape}, "
                f"{self.parents.dtype}{self.parents.shape}, {self.scores.dtype}{self.scores.shape}"
            )

    @classmethod
    def empty(cls) -> RetrievedTree:
        """A tree with no nodes (nothing retrieved)."""
        return cls(
            tokens=np.zeros(0, dtype=np.int64),
            parents=np.zeros(0, dtype=np.int64),
            scores=np.zeros(0, dtype=np.float32),
        )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def validate(self) -> None:
        """Raise ValueError unless every documented invariant holds."""
        m = len(self)
        child_tokens: dict[int, set[int]] = {}
        last_child: dict[int, int] = {}
        for i in range(m):
            parent = int(self.parents[i])
            if not -1 <= parent < i:
                raise ValueError(f"node {i}: parent {parent} is not in [-1, {i})")
            token = int(self.tokens[i])
            siblings = child_tokens.setdefault(parent, set())
            if token in siblings:
                raise ValueError(f"node {i}: token {token} repeats a sibling")
            siblings.add(token)
            previous = last_child.get(parent)
            if previous is not None and self.scores[i] > self.scores[previous]:
                raise ValueError(f"node {i}: score exceeds its earlier sibling {previous}")
            last_child[parent] = i

    def depths(self) -> np.ndarray:
        """Depth of each node (1 = child of the root); int64 numpy [M]."""
        depth = np.zeros(len(self), dtype=np.int64)
        for i, parent in enumerate(self.parents.tolist()):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
        return depth


def stack_trees(
    trees: Sequence[RetrievedTree],
    max_nodes: int,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad a batch of trees to ``max_nodes`` nodes each.

    Returns ``(tokens [bs, max_nodes] int64, parents [bs, max_nodes] int64,
    scores [bs, max_nodes] float32, valid [bs, max_nodes] bool)``. Padding slots hold token 0,
    parent -1, score -inf and valid False. A tree longer than ``max_nodes`` keeps its first
    ``max_nodes`` nodes, which is still a tree because nodes are in topological order.
    """
    if max_nodes < 0:
        raise ValueError(f"max_nodes must be >= 0, got {max_nodes}")
    batch = len(trees)
    tokens = np.zeros((batch, max_nodes), dtype=np.int64)
    parents = np.full((batch, max_nodes), -1, dtype=np.int64)
    scores = np.full((batch, max_nodes), -np.inf, dtype=np.float32)
    valid = np.zeros((batch, max_nodes), dtype=np.bool_)
    for row, tree in enumerate(trees):
        m = min(len(tree), max_nodes)
        tokens[row, :m] = tree.tokens[:m]
        parents[row, :m] = tree.parents[:m]
        scores[row, :m] = tree.scores[:m]
        valid[row, :m] = True
    out = (
        torch.from_numpy(tokens),
        torch.from_numpy(parents),
        torch.from_numpy(scores),
        torch.from_numpy(valid),
    )
    if device is not None:
        out = tuple(t.to(device, non_blocking=True) for t in out)
    return out

"""Data types of the GRAFT tree core, and the package's vocabulary.

Glossary (one name per quantity in ``sglang_graft``; SGLang's names appear only in
``sglang_graft.sglang``, where they are translated):

* ``num_nodes`` (``N``): the verify budget, tree nodes per request *root included*. SGLang:
  ``--speculative-num-draft-tokens``, ``speculative_num_draft_tokens``, ``draft_token_num``,
  ``num_draft_tokens``, ``num_verify_tokens``. ``budgets``: the ``N`` a cost-aware step may choose.
* ``slots``: the ``N - 1`` non-root positions (the paper's budget of 60 is 60 slots, ``N = 61``);
  ``free_slots``: those pruning leaves to retrieval.
* ``budget_mode``: how ``N`` is chosen, ``cost`` (per step) or ``fixed``
  (``--speculative-graft-budget-mode``).
* ``num_steps`` / ``topk``: draft levels and beams (SGLang: ``--speculative-num-steps`` /
  ``--speculative-eagle-topk``); ``passes``: draft forward passes a step ran.
* ``root_tokens`` ``[bs]``: each request's last committed token, node 0 of its tree (SGLang:
  ``verified_id``, ``spec_info.bonus_tokens``).
* ``pool`` (:class:`DraftPool`, ``[bs, M]``): every draft candidate; ``pool index``: a position
  in it. Its ``scores`` are SGLang's cumulative draft path probabilities.
* ``proposals`` (:class:`RetrievalProposals`, ``[bs, R]``): retrieved nodes; ``proposal index``:
  a position in them. ``priority``: the order graft places them in. ``value``: a node's calibrated
  probability of being accepted (the engine's acceptance calibration); the cost-aware step uses
  the value as the priority.
* ``slot`` / ``node``: a position ``0 .. N-1`` in one request's tree; ``flat_index``: the row
  ``b * N + i`` of node ``i`` of request ``b`` in the batch's flat verify rows (SGLang:
  ``retrive_index`` / ``retrieve_index``); ``first_child`` / ``next_sibling``: the links verify
  walks (SGLang: ``retrive_next_token`` / ``retrive_next_sibling``).
* ``bonus token``: the target's token after the last accepted node; it closes the step's
  committed tokens and is the next step's root.
* ``stage``: the pruning stage, the first confidence checkpoint that failed.

``tree/draft.py`` reads SGLang's draft outputs (``score_list``, ``parent_list``,
``top_scores_index``, ``verified_id``) under SGLang's names: it is where they enter the package.

Every tensor here is batched: the first dimension is the batch (``bs``) and the shapes are
fixed by configuration (draft ``topk``/``num_steps``, the node budget ``N``, the retrieval
width ``R``), never by tensor values, so the whole prune -> graft -> flatten path can be
captured in a CUDA graph.

Conventions shared by all modules:

* A *tree* of ``N`` nodes is ``tokens [bs, N] int64`` plus ``parents [bs, N] int64``; node 0
  is the root (the last committed / bonus token) with parent ``-1``, and ``parents[i] < i``.
* *Draft depth* 0 is the first draft level, i.e. the children of the root (SGLang's first
  ``score_list`` entry); a node at draft depth ``d`` sits at tree depth ``d + 1``.
* ``linked [bs, N] bool`` says whether a node is entered in its parent's child list
  (``first_child`` / ``next_sibling``). Padding nodes are not linked, so the
  verification walk can never reach, let alone accept, them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Optional, Tuple

import torch

__all__ = [
    "draft_pool_size",
    "PAPER_CHECKPOINT_DEPTHS",
    "PAPER_KEEP_PER_STAGE",
    "PAPER_BUDGET",
    "DEFAULT_THRESHOLDS",
    "TreeMaskMode",
    "DraftPool",
    "RetrievalProposals",
    "PruneConfig",
    "PrunedDraft",
    "GraftTree",
    "VerifyLayout",
]


# The paper's 60-node example (Sec. 3.1): checkpoints at draft depths 0, 1 and 5 keep 8, 24 or 40
# draft nodes of a budget of 60 non-root slots (N = 61 in SGLang's counting, root included).
PAPER_CHECKPOINT_DEPTHS: Tuple[int, ...] = (0, 1, 5)
PAPER_KEEP_PER_STAGE: Tuple[int, ...] = (8, 24, 40)
PAPER_BUDGET = 60
# Confidence thresholds per checkpoint (a third-party reimplementation's choice, to be calibrated).
DEFAULT_THRESHOLDS: Tuple[float, ...] = (0.35, 0.25, 0.15)


def draft_pool_size(topk: int, num_steps: int) -> int:
    """Candidates ``M`` of one EAGLE draft round: ``topk`` at draft depth 0, then ``topk**2``
    expansions per later step (``topk = 1``: a chain of ``num_steps`` tokens)."""
    return topk + (num_steps - 1) * topk * topk


class TreeMaskMode(IntEnum):
    """Encodings of the verify attention mask, numbered as SGLang's ``TreeMaskMode``.

    * ``FULL_MASK``: per request ``N`` rows of ``seq_len + N`` bools (prefix columns True,
      then the ``N x N`` ancestor-or-self block), requests concatenated, flat.
    * ``QLEN_ONLY``: only the ``N x N`` blocks, ``[bs * N * N]`` flat.
    * ``QLEN_ONLY_BITPACKING``: one integer per row, bit ``j`` set when node ``j`` is an
      ancestor-or-self; uint8 / uint16 / uint32 for ``N`` <= 8 / 16 / 32.
    """

    FULL_MASK = 0
    QLEN_ONLY = 1
    QLEN_ONLY_BITPACKING = 2


@dataclass
class DraftPool:
    """Every candidate of one EAGLE draft round, in SGLang's flat score-list order.

    ``M = draft_pool_size(topk, num_steps)``: the ``topk`` first-level candidates, then for
    each later step the ``topk * topk`` expansions of the ``topk`` beams kept at the previous
    step (``torch.cat(score_list, 1).flatten(1)`` in SGLang's ``organize_draft_results``).

    Attributes:
        tokens: ``[bs, M] int64`` candidate token ids (target vocabulary).
        parents: ``[bs, M] int64`` pool index of the parent, ``-1`` for children of the root;
            ``parents[m] < m``.
        scores: ``[bs, M] float32`` cumulative path probability (product of draft
            probabilities along the path), so ``exp(cumulative log-score)``.
        depths: ``[bs, M] int64`` draft depth (0 = children of the root).
        topk: draft branching factor.
        num_steps: number of draft steps (deepest draft depth is ``num_steps - 1``).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    depths: torch.Tensor
    topk: int
    num_steps: int

    @property
    def size(self) -> int:
        """Number of candidates ``M`` per request."""
        return self.tokens.shape[1]


@dataclass
class RetrievalProposals:
    """Retrieved token trees, one padded proposal per request.

    Attributes:
        tokens: ``[bs, R] int64`` token ids.
        parents: ``[bs, R] int64`` index into the same ``R`` nodes, ``-1`` = child of the
            graft anchor (the root in the published placement); ``parents[j] < j``.
        priority: ``[bs, R] float32`` the order graft places nodes in (higher first). Only the
            order matters; graft ranks a node by the minimum priority on its path, so every
            cut keeps whole root paths. The cost-aware step passes each node's value here.
        valid: ``[bs, R] bool``; invalid entries (and their descendants) are ignored.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    priority: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def empty(batch_size: int, device: torch.device | str = "cpu") -> "RetrievalProposals":
        """Proposals with ``R = 0`` nodes (a draft-only tree)."""
        z = torch.zeros((batch_size, 0), dtype=torch.int64, device=device)
        return RetrievalProposals(
            tokens=z,
            parents=z.clone(),
            priority=torch.zeros((batch_size, 0), dtype=torch.float32, device=device),
            valid=torch.zeros((batch_size, 0), dtype=torch.bool, device=device),
        )


@dataclass(frozen=True)
class PruneConfig:
    """Confidence checkpoints and the draft / retrieval split of each pruning stage.

    At checkpoint ``k`` (draft depth ``checkpoint_depths[k]``) the confidence is
    ``c_d = max cumulative path probability at that depth`` (= ``exp`` of the max
    cumulative log-score). The stage of a request is the index of the first checkpoint with
    ``c_d < thresholds[k]``, or ``len(checkpoint_depths)`` when all pass. Stage ``s`` keeps
    the ``keep_per_stage[s]`` best draft nodes; the all-pass stage keeps
    ``N - 1 - min_retrieval_slots``. The remaining ``N - 1 - kept`` non-root slots go to
    retrieval.

    The defaults are the paper's 60-node example (checkpoints at draft depths 0, 1, 5;
    keep 8 / 24 / 40). The paper's budget of 60 does not count the root, so it corresponds
    to ``N = 61`` here (SGLang's ``--speculative-num-draft-tokens`` counts the root). The
    threshold defaults (0.35, 0.25, 0.15) come from a third-party reimplementation and are
    meant to be calibrated.
    """

    checkpoint_depths: Tuple[int, ...] = PAPER_CHECKPOINT_DEPTHS
    thresholds: Tuple[float, ...] = DEFAULT_THRESHOLDS
    keep_per_stage: Tuple[int, ...] = PAPER_KEEP_PER_STAGE
    min_retrieval_slots: int = 0

    def __post_init__(self) -> None:
        n = len(self.checkpoint_depths)
        if len(self.thresholds) != n or len(self.keep_per_stage) != n:
            raise ValueError(
                "checkpoint_depths, thresholds and keep_per_stage need the same length, got "
                f"{self.checkpoint_depths}, {self.thresholds}, {self.keep_per_stage}"
            )
        if any(d < 0 for d in self.checkpoint_depths) or list(self.checkpoint_depths) != sorted(
            set(self.checkpoint_depths)
        ):
            raise ValueError(f"checkpoint_depths must be increasing and >= 0: {self.checkpoint_depths}")
        if any(k < 0 for k in self.keep_per_stage) or self.min_retrieval_slots < 0:
            raise ValueError("keep_per_stage and min_retrieval_slots must be >= 0")

    def keep_table(self, num_nodes: int) -> Tuple[int, ...]:
        """Draft nodes kept per stage (length ``len(checkpoint_depths) + 1``) for budget ``N``."""
        slots = num_nodes - 1
        if slots < 0:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        table = tuple(self.keep_per_stage) + (max(slots - self.min_retrieval_slots, 0),)
        return tuple(min(k, slots) for k in table)


@dataclass
class PrunedDraft:
    """Result of :func:`prune_by_confidence`.

    Attributes:
        keep: ``[bs, M] bool`` kept draft candidates; ancestor-closed.
        stage: ``[bs] int64`` pruning stage (index of the first failing checkpoint, or the
            number of checkpoints when all pass).
        confidence: ``[bs, C] float32`` ``c_d`` at each checkpoint.
        num_kept: ``[bs] int64`` number of kept draft nodes (``keep.sum(1)``).
    """

    keep: torch.Tensor
    stage: torch.Tensor
    confidence: torch.Tensor
    num_kept: torch.Tensor


@dataclass
class GraftTree:
    """The hybrid draft + retrieval tree of exactly ``N`` nodes per request.

    Slot order: root (0), kept draft nodes in pool order, new retrieved nodes in proposal
    order, then padding. Parents precede children.

    Attributes:
        tokens: ``[bs, N] int64``; padding slots hold ``pad_token_id``.
        parents: ``[bs, N] int64``; -1 for the root, padding hangs under the root.
        linked: ``[bs, N] bool`` real non-root nodes (entered in the sibling lists).
        from_draft: ``[bs, N] bool`` node is a kept draft node.
        from_retrieval: ``[bs, N] bool`` node was proposed by retrieval (a merged node is
            both draft and retrieval).
        draft_index: ``[bs, N] int64`` pool index of a draft node, else -1.
        proposal_index: ``[bs, N] int64`` proposal index of a retrieved node, else -1.
        proposal_slot: ``[bs, R] int64`` slot each proposal node ended up in (its own slot,
            or the slot it was merged into), -1 when dropped (budget, invalid, duplicate).
        num_draft: ``[bs] int64`` kept draft nodes.
        num_retrieved: ``[bs] int64`` new nodes added by retrieval.
        num_merged: ``[bs] int64`` proposal nodes merged into an existing draft node.
        anchor_slot: ``[bs] int64`` slot the retrieved tree hangs under.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    linked: torch.Tensor
    from_draft: torch.Tensor
    from_retrieval: torch.Tensor
    draft_index: torch.Tensor
    proposal_index: torch.Tensor
    proposal_slot: torch.Tensor
    num_draft: torch.Tensor
    num_retrieved: torch.Tensor
    num_merged: torch.Tensor
    anchor_slot: torch.Tensor


@dataclass
class VerifyLayout:
    """SGLang's verify inputs for a batch of ``N``-node trees (``build_tree_kernel_efficient``).

    Attributes:
        draft_token: ``[bs * N] int64`` node tokens, root first (None when built from
            topology alone).
        positions: ``[bs * N] int64`` ``seq_len + depth``.
        ancestor_mask: ``[bs, N, N] bool`` ``[b, i, j]`` = node ``j`` is an ancestor-or-self
            of node ``i``.
        flat_index: ``[bs, N] int64`` global row ``b * N + i``.
        first_child: ``[bs, N] int64`` first linked child, -1 if none.
        next_sibling: ``[bs, N] int64`` next linked sibling (ascending node index,
            the order of SGLang's kernel), -1 if none.
        depth: ``[bs, N] int64`` tree depth (root 0).
        max_depth: ``[bs] int64`` deepest node reachable through the links; the verify
            kernels need an ``accept_index`` width of at least ``max_depth + 1``.
        tree_mask: flat mask in the encoding requested from the builder, or None.
        ancestor_bits: ``[bs, N] int64`` the ancestor mask as bitmasks (bit ``j`` = column
            ``j``), when the builder produced them (the ``tree_layout`` kernel), else None.
    """

    draft_token: Optional[torch.Tensor]
    positions: torch.Tensor
    ancestor_mask: torch.Tensor
    flat_index: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    depth: torch.Tensor
    max_depth: torch.Tensor
    tree_mask: Optional[torch.Tensor] = None
    ancestor_bits: Optional[torch.Tensor] = None

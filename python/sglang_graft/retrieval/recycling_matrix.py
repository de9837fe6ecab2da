"""Token-recycling adjacency matrix: the target model's top-k successors of every token.

The matrix is a ``[vocab, k]`` int32 table held on the model's device. After each
verification step the worker writes, for every verified node (accepted or rejected), the
target's top-k next tokens at that node into the node token's row (``update``). Proposals
expand a static BFS template from each request's root token, one gather per depth, for the
whole batch at once (``propose``): no Python loop over nodes and no host synchronisation.

Choices, documented because callers depend on them:

* Initial content: every row holds the sentinel ``vocab_size`` (an id no model emits), and each
  table has one extra row ``vocab_size`` that holds the sentinel too (and a dump row after it). A node read from an
  unfilled row is therefore the sentinel, and so are all nodes below it, which lets ``propose``
  carry validity inside the token values (one gather per depth, no mask arithmetic). Outputs
  turn sentinel nodes into token 0 with ``valid`` False. ``filled`` is derived from the table.
* Duplicate tokens in one ``update``: the *last* occurrence wins. Every write to a row carries
  the winner's data, so the scatter is deterministic whatever order the device applies it in.
* Template: a static tree built once per ``widths`` from ``k``. At depth ``d + 1`` the ``w``
  slots go to the (parent at depth ``d``, rank ``r``) pairs with the smallest cumulative rank
  (the sum of ranks on the path), ties broken by the parent's cumulative rank, then the
  parent's index, then ``r``. The greedy chain (all ranks 0) has cumulative rank 0, so it is
  the first node at every depth and runs deepest. Each node's static score is minus its
  cumulative rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..kernels import device_kernels

__all__ = ["scatter_last_wins", "RecyclingMatrix", "RecyclingTemplate", "ScopeTable", "DEFAULT_WIDTHS", "build_template"]

# Published token-recycling profile: 52 nodes over 9 depths.
DEFAULT_WIDTHS: tuple[int, ...] = (8, 10, 8, 6, 5, 4, 4, 4, 3)


@dataclass(frozen=True)
class RecyclingTemplate:
    """A static proposal tree; every array is length K (the node count), in BFS order.

    parents: int64 [K] (-1 = child of the root, parents[i] < i); ranks: int64 [K], which
    column of the parent's row supplies the token; cumulative_ranks: int64 [K]; scores:
    float32 [K] (= -cumulative_ranks); depth_offsets: int64 [D + 1], nodes of depth d + 1 are
    ``[depth_offsets[d], depth_offsets[d + 1])``.
    """

    widths: tuple[int, ...]
    k: int
    parents: np.ndarray
    ranks: np.ndarray
    cumulative_ranks: np.ndarray
    scores: np.ndarray
    depth_offsets: np.ndarray

    def __len__(self) -> int:
        return int(self.parents.shape[0])


def build_template(widths: Sequence[int], k: int) -> RecyclingTemplate:
    """Static BFS tree with ``widths[d]`` nodes at depth ``d + 1`` (see module docstring)."""
    widths = tuple(int(w) for w in widths)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if any(w < 1 for w in widths):
        raise ValueError(f"widths must be positive, got {widths}")
    parents: list[int] = []
    ranks: list[int] = []
    cumulative: list[int] = []
    offsets = [0]
    frontier = [(-1, 0)]  # (node index, cumulative rank); the root has cumulative rank 0
    for depth, width in enumerate(widths):
        candidates = sorted(
            (parent_cum + r, parent_cum, parent, r)
            for parent, parent_cum in frontier
            for r in range(k)
        )
        if width > len(candidates):
            raise ValueError(
                f"width {width} at depth {depth + 1} exceeds the {len(candidates)} slots "
                f"that {len(frontier)} parents with k={k} offer"
            )
        frontier = []
        for cum, _, parent, r in candidates[:width]:
            frontier.append((len(parents), cum))
            parents.append(parent)
            ranks.append(r)
            cumulative.append(cum)
        offsets.append(len(parents))
    cumulative_ranks = np.array(cumulative, dtype=np.int64)
    return RecyclingTemplate(
        widths=widths,
        k=k,
        parents=np.array(parents, dtype=np.int64),
        ranks=np.array(ranks, dtype=np.int64),
        cumulative_ranks=cumulative_ranks,
        scores=(-cumulative_ranks).astype(np.float32),
        depth_offsets=np.array(offsets, dtype=np.int64),
    )


class _DeviceTemplate:
    """A template's index tensors on one device, sliced per depth once.

    levels[d] = (ranks [w_d], parents relative to depth d's first node [w_d]); depth 1 reads
    the roots, so its parents are None.
    """

    def __init__(self, template: RecyclingTemplate, device: torch.device) -> None:
        self.template = template
        self.parents = torch.from_numpy(template.parents).to(device)
        self.scores = torch.from_numpy(template.scores).to(device)
        self.levels: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        offsets = template.depth_offsets.tolist()
        for d in range(len(offsets) - 1):
            begin, end = offsets[d], offsets[d + 1]
            ranks = torch.from_numpy(template.ranks[begin:end]).to(device)
            parents = None
            if d > 0:
                parents = torch.from_numpy(template.parents[begin:end] - offsets[d - 1]).to(device)
            self.levels.append((ranks, parents))


def scatter_last_wins(table: torch.Tensor, rows_index: torch.Tensor, node_topk: torch.Tensor) -> None:
    """``table[rows_index[i]] = node_topk[i]``, the last duplicate winning (torch reference of
    the ``recycle_scatter`` kernel).

    A stable sort groups equal rows with their original order kept, so the last member of each
    run is the last occurrence; every member then writes the winner's row, so the result does
    not depend on the order the device applies the writes in.
    """
    n = rows_index.shape[0]
    sorted_rows, order = torch.sort(rows_index, stable=True)
    positions = torch.arange(n, device=rows_index.device)
    run_last = torch.ones(n, dtype=torch.bool, device=rows_index.device)
    run_last[:-1] = sorted_rows[1:] != sorted_rows[:-1]
    run_end = torch.where(run_last, positions, n)
    run_end = torch.flip(torch.cummin(torch.flip(run_end, (0,)), 0).values, (0,))
    winners = order[run_end]
    table.index_copy_(0, sorted_rows, node_topk.index_select(0, winners).to(table.dtype))


class RecyclingMatrix:
    """``[vocab_size, k]`` successor tables, one per scope, with batched update and proposals.

    A scope is one independent table (``num_scopes`` of them, all on one device); every row of a
    batch names its scope, so requests that must not share what they learn (different tenants)
    use different scopes in the same call. Scope 0 is the only one by default.

    Args:
        vocab_size: rows of a table (token ids must be in ``[0, vocab_size)``).
        k: successors kept per token.
        widths: default template (``DEFAULT_WIDTHS``: 52 nodes, needs ``k >= 8``).
        device: where the tables live (the model's device in serving).
        num_scopes: independent tables.
    """

    def __init__(
        self,
        vocab_size: int,
        k: int = 8,
        widths: Sequence[int] = DEFAULT_WIDTHS,
        device: torch.device | str = "cpu",
        num_scopes: int = 1,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if num_scopes < 1:
            raise ValueError(f"num_scopes must be >= 1, got {num_scopes}")
        self.vocab_size = int(vocab_size)
        self.k = int(k)
        self.num_scopes = int(num_scopes)
        self.device = torch.device(device)
        # Per scope vocab_size + 2 rows: the tokens, the sentinel row ``vocab_size`` (read by
        # proposals, never written) and the dump row ``vocab_size + 1`` (absorbs the writes of
        # rows that are not real nodes, so updates have fixed shapes).
        self.rows_per_scope = self.vocab_size + 2
        self.successors = torch.full(
            (self.num_scopes * self.rows_per_scope, self.k), self.vocab_size, dtype=torch.int32, device=self.device
        )
        self.default_widths = tuple(int(w) for w in widths)
        self._templates: dict[tuple[int, ...], _DeviceTemplate] = {}
        self._template(self.default_widths)  # validate widths against k now

    @property
    def nbytes(self) -> int:
        """Bytes of all tables."""
        return self.successors.nbytes

    def scope_table(self, scope: int = 0) -> torch.Tensor:
        """int32 [vocab_size, k]: scope ``scope``'s successor rows (unfilled rows hold ``vocab_size``)."""
        start = scope * self.rows_per_scope
        return self.successors[start : start + self.vocab_size]

    @property
    def table(self) -> torch.Tensor:
        """int32 [vocab_size, k]: scope 0's successor rows."""
        return self.scope_table(0)

    @property
    def filled(self) -> torch.Tensor:
        """bool [vocab_size]: scope 0's rows written by ``update`` since creation or ``reset``."""
        return self.table[:, 0] != self.vocab_size

    def template(self, widths: Sequence[int] | None = None) -> RecyclingTemplate:
        """The static tree used for ``widths`` (default: the constructor's)."""
        return self._template(self._widths(widths)).template

    def _widths(self, widths: Sequence[int] | None) -> tuple[int, ...]:
        return self.default_widths if widths is None else tuple(int(w) for w in widths)

    def _template(self, widths: tuple[int, ...]) -> _DeviceTemplate:
        cached = self._templates.get(widths)
        if cached is None:
            cached = _DeviceTemplate(build_template(widths, self.k), self.device)
            self._templates[widths] = cached
        return cached

    def _scope_offsets(self, scopes: torch.Tensor | None, n: int) -> torch.Tensor | int:
        if scopes is None:
            return 0
        if scopes.shape != (n,):
            raise ValueError(f"scopes must be [{n}], got {tuple(scopes.shape)}")
        return scopes.to(torch.int64) * self.rows_per_scope

    def reset(self, scope: int | None = None) -> None:
        """Forget every row of ``scope`` (every scope when None)."""
        if scope is None:
            self.successors.fill_(self.vocab_size)
        else:
            start = scope * self.rows_per_scope
            self.successors[start : start + self.rows_per_scope].fill_(self.vocab_size)

    def update(
        self,
        node_tokens: torch.Tensor,
        node_topk: torch.Tensor,
        scopes: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Write ``node_topk[i]`` into row ``node_tokens[i]`` of scope ``scopes[i]``; the last
        duplicate wins.

        node_tokens: int64 [n] on the table's device, each in ``[0, vocab_size)`` where valid;
        node_topk: int64 (or int32) [n, k], the target's top-k next tokens at each node, best
        first, each in ``[0, vocab_size)`` and distinct within a row (as ``torch.topk`` gives),
        so siblings in proposals are distinct; scopes: int64 [n] (default all 0); valid: bool
        [n], rows that are not real nodes write to a dump row (fixed shapes, no boolean
        indexing). No host synchronisation.
        """
        n = node_tokens.shape[0]
        if node_topk.shape != (n, self.k):
            raise ValueError(f"node_topk must be [{n}, {self.k}], got {tuple(node_topk.shape)}")
        if n == 0:
            return
        rows_index = self.row_index(node_tokens, scopes, valid)
        kernels = device_kernels(self.successors.device)
        if kernels is not None:
            kernels.recycle_scatter(self.successors, rows_index, node_topk)
        else:
            scatter_last_wins(self.successors, rows_index, node_topk)

    def row_index(
        self, node_tokens: torch.Tensor, scopes: torch.Tensor | None = None, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """int64 [n]: the table row each node writes (its scope's row, or the scope's dump row
        where ``valid`` is False)."""
        rows_index = node_tokens.to(torch.int64)
        if valid is not None:
            rows_index = torch.where(valid, rows_index, self.vocab_size + 1)
        return rows_index + self._scope_offsets(scopes, node_tokens.shape[0])

    def propose(
        self, root_tokens: torch.Tensor, widths: Sequence[int] | None = None, scopes: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expand the template under every root token, in its scope's table.

        root_tokens: int64 [bs] (the last token of each request's context, in
        ``[0, vocab_size)``); scopes: int64 [bs] (default all 0). Returns
        ``(tokens [bs, K] int64, valid [bs, K] bool)``; invalid nodes hold token 0. The tree
        shape is ``template(widths).parents`` ([K], shared by the batch). Two gathers per
        depth, then three ops for the whole tree.
        """
        plan = self._template(self._widths(widths))
        offsets = self._scope_offsets(scopes, root_tokens.shape[0])
        if isinstance(offsets, torch.Tensor):
            offsets = offsets.unsqueeze(1)
        levels = []
        parent_tokens = root_tokens.to(torch.int64).unsqueeze(1)  # [bs, 1], broadcast against depth 1's ranks
        for ranks, parents in plan.levels:
            if parents is not None:
                parent_tokens = levels[-1][:, parents].to(torch.int64)
            levels.append(self.successors[parent_tokens + offsets, ranks])  # int32 [bs, w_d]
        tokens = torch.cat(levels, dim=1)
        valid = tokens != self.vocab_size
        return torch.where(valid, tokens, 0).to(torch.int64), valid

    def propose_padded(
        self, root_tokens: torch.Tensor, widths: Sequence[int] | None = None, scopes: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``propose`` in the padded batch format of ``stack_trees``.

        Returns ``(tokens [bs, K] int64, parents [bs, K] int64, scores [bs, K] float32,
        valid [bs, K] bool)``; invalid slots hold token 0, parent -1 and score -inf. The valid
        nodes are closed under taking parents but need not be a prefix of the K slots.
        """
        plan = self._template(self._widths(widths))
        tokens, valid = self.propose(root_tokens, widths, scopes)
        bs = root_tokens.shape[0]
        parents = torch.where(valid, plan.parents.unsqueeze(0).expand(bs, -1), -1)
        scores = torch.where(valid, plan.scores.unsqueeze(0), float("-inf"))
        return tokens, parents, scores, valid


class ScopeTable:
    """Which recycling-matrix scope each live request uses (host side, deterministic).

    Requests with the same key share a scope; a scope lives while a request uses it and is then
    kept for its key until another key needs the slot (least recently used first), when it is
    handed over empty. Assignment depends only on the order of ``acquire`` / ``release`` calls,
    so every tensor-parallel rank assigns the same scopes.

    Example: with 2 scopes, ``acquire("a", "t1") -> 0``, ``acquire("b", "t1") -> 0``,
    ``acquire("c", "t2") -> 1``; after ``release`` of all three, ``acquire("d", "t3")`` reuses
    scope 0 (t1, least recently used) and reports it must be reset.
    """

    def __init__(self, num_scopes: int) -> None:
        self.num_scopes = int(num_scopes)
        self._scope_of_key: dict = {}
        self._key_of_scope: list = [None] * self.num_scopes
        self._users = [0] * self.num_scopes
        self._last_use = [0] * self.num_scopes
        self._used = [False] * self.num_scopes  # written since the scope was last emptied
        self._clock = 0
        self._request: dict = {}

    def acquire(self, rid, key) -> tuple[int, bool]:
        """Scope for request ``rid`` with sharing key ``key``; ``(scope, must_reset)``: the scope
        holds another key's rows and must be emptied before use."""
        if rid in self._request:
            return self._request[rid], False
        self._clock += 1
        fresh = False
        scope = self._scope_of_key.get(key)
        if scope is None:
            idle = [s for s in range(self.num_scopes) if self._users[s] == 0]
            if not idle:
                raise RuntimeError(f"all {self.num_scopes} recycling scopes are in use")
            scope = min(idle, key=lambda s: (self._key_of_scope[s] is not None, self._last_use[s], s))
            old = self._key_of_scope[scope]
            if old is not None:
                del self._scope_of_key[old]
            fresh = self._used[scope]
            self._used[scope] = True
            self._key_of_scope[scope] = key
            self._scope_of_key[key] = scope
        self._users[scope] += 1
        self._last_use[scope] = self._clock
        self._request[rid] = scope
        return scope, fresh

    def scope(self, rid) -> int:
        return self._request[rid]

    def release(self, rid, forget: bool = False) -> None:
        """``rid`` is done; with ``forget`` its scope is emptied once unused (per-request scopes)."""
        scope = self._request.pop(rid, None)
        if scope is None:
            return
        self._users[scope] -= 1
        if forget and self._users[scope] == 0:
            key = self._key_of_scope[scope]
            self._scope_of_key.pop(key, None)
            self._key_of_scope[scope] = None

    def live(self) -> int:
        return len(self._request)

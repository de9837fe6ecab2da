"""Shared helpers for the tree-core tests: EAGLE draft simulation, random retrieval
proposals, brute-force tree references, and SGLang's Triton tree kernels loaded from the
installed SGLang sources (run by the Triton interpreter on CPU tensors)."""

from __future__ import annotations

import atexit
import importlib.util
import io
import os
import pathlib
import struct
import subprocess
import sys
from enum import IntEnum
from typing import Optional

import pytest
import torch

from sglang_graft.tree import DraftPool, RetrievalProposals, draft_pool_from_sglang

_CUDA = torch.cuda.is_available()

#: Device parametrisation: every tree test runs on CPU; the same test on CUDA is marked gpu.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _CUDA, reason="needs CUDA")]),
]


# --------------------------------------------------------------------------------------
# EAGLE draft simulation (SGLang's select_top_k_tokens / organize_draft_results, restated)
# --------------------------------------------------------------------------------------


def simulate_eagle_draft(
    bs: int, topk: int, num_steps: int, vocab: int, gen: torch.Generator, sharpness: float = 1.5
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Random draft with SGLang's ``score_list`` / ``token_list`` / ``parents_list`` layout."""

    def step_topk(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * sharpness, dim=-1)
        return torch.topk(probs, topk, dim=-1)

    topk_p, topk_index = step_topk(bs)
    score_list = [topk_p.unsqueeze(1)]
    token_list = [topk_index]
    parents_list = [torch.arange(-1, topk, dtype=torch.long).expand(bs, -1)]
    scores = topk_p
    for i in range(1, num_steps):
        topk_p, topk_index = step_topk(bs * topk)
        expand_scores = scores.unsqueeze(2) * topk_p.view(-1, topk, topk)
        topk_cs_p, topk_cs_index = torch.topk(expand_scores.flatten(start_dim=1), topk, dim=-1)
        score_list.append(expand_scores)
        token_list.append(topk_index.view(-1, topk * topk))
        parents_list.append(topk_cs_index + (topk * topk * (i - 1) + topk))
        scores = topk_cs_p
    return score_list, token_list, parents_list


def organize_draft_results(score_list, token_list, parents_list, num_draft_token):
    """SGLang's ``organize_draft_results`` (eagle_utils.py), restated."""
    scores = torch.cat(score_list, dim=1).flatten(1)
    tokens = torch.cat(token_list, dim=1)
    top = torch.sort(torch.topk(scores, num_draft_token - 1, dim=-1).indices).values
    draft_tokens = torch.gather(tokens, 1, top)
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty(scores.shape[0], 0, dtype=torch.long)
    return parent_list, top, draft_tokens


def random_pool(bs: int, topk: int, num_steps: int, vocab: int, seed: int) -> DraftPool:
    gen = torch.Generator().manual_seed(seed)
    s, t, p = simulate_eagle_draft(bs, topk, num_steps, vocab, gen)
    return draft_pool_from_sglang(s, t, p, topk, num_steps)


# --------------------------------------------------------------------------------------
# Retrieval proposals
# --------------------------------------------------------------------------------------


def random_proposals(
    bs: int,
    r: int,
    vocab: int,
    gen: torch.Generator,
    pool: Optional[DraftPool] = None,
    copy_len: int = 3,
    invalid_tail: int = 2,
) -> RetrievalProposals:
    """Random retrieved trees with unique siblings.

    With ``pool``, each proposal starts with a copy of the token path of a deep draft node
    (so grafting at the root must merge it), then grows random nodes anywhere. The last
    ``invalid_tail`` entries are padding (``valid`` False).
    """
    tokens = torch.zeros(bs, r, dtype=torch.long)
    parents = torch.full((bs, r), -1, dtype=torch.long)
    valid = torch.zeros(bs, r, dtype=torch.bool)
    scores = torch.zeros(bs, r)
    for b in range(bs):
        children: dict[int, set[int]] = {}
        n_real = max(r - invalid_tail, 0)
        j = 0
        if pool is not None and copy_len > 0:
            m = pool.tokens.shape[1]
            order = torch.argsort(pool.depths[b] * 10 + pool.scores[b], descending=True)
            node = int(order[int(torch.randint(0, min(4, m), (1,), generator=gen))])
            path = []
            while node >= 0:
                path.append(int(pool.tokens[b, node]))
                node = int(pool.parents[b, node])
            chain = list(reversed(path))[:copy_len]
            for tok in chain:
                if j >= n_real:
                    break
                par = j - 1
                tokens[b, j], parents[b, j], valid[b, j] = tok, par, True
                children.setdefault(par, set()).add(tok)
                scores[b, j] = 1.0 - 0.01 * j
                j += 1
        while j < n_real:
            par = int(torch.randint(-1, j, (1,), generator=gen)) if j else -1
            used = children.setdefault(par, set())
            free = [t for t in range(vocab) if t not in used]
            if not free:
                par, used = -1, children.setdefault(-1, set())
                free = [t for t in range(vocab) if t not in used]
                if not free:
                    break
            tok = free[int(torch.randint(0, len(free), (1,), generator=gen))]
            used.add(tok)
            tokens[b, j], parents[b, j], valid[b, j] = tok, par, True
            scores[b, j] = float(torch.rand(1, generator=gen))
            j += 1
    return RetrievalProposals(tokens=tokens, parents=parents, priority=scores, valid=valid)


# --------------------------------------------------------------------------------------
# Brute-force references
# --------------------------------------------------------------------------------------


def py_children(parents: list[int], linked: list[bool]) -> dict[int, list[int]]:
    """Linked children of every node, ascending index."""
    kids: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for i, p in enumerate(parents):
        if p >= 0 and linked[i]:
            kids[p].append(i)
    return kids


def py_ancestors(parents: list[int], i: int) -> list[int]:
    """``i`` and its ancestors up to the root."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out


def py_greedy_walk(tokens, parents, linked, target_argmax, width):
    """Brute-force greedy acceptance: returns (accepted node ids incl. root, bonus token)."""
    kids = py_children(parents, linked)
    path = [0]
    while len(path) < width:
        cur = path[-1]
        nxt = [c for c in kids[cur] if tokens[c] == target_argmax[cur]]
        if not nxt:
            break
        path.append(nxt[0])
    return path, target_argmax[path[-1]]


def chi2_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness-of-fit p-value; cells with small expectation are pooled."""
    observed = observed.double().flatten()
    n = observed.sum()
    expected = expected_probs.double().flatten() * n
    small = expected < min_expected
    if bool(observed[expected == 0].sum() > 0):
        return 0.0
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


# --------------------------------------------------------------------------------------
# SGLang's Triton tree kernels, from the installed SGLang sources
# --------------------------------------------------------------------------------------

# Runs in a child process: the Triton interpreter must be selected before triton is
# imported (its standard library, e.g. tl.sum, is compiled at import), and this test process
# must not switch other tests' kernels to the interpreter.
_KERNEL_WORKER = r"""
import ast, io, os, struct, sys
# Results travel over the original stdout; anything else printed goes to stderr.
out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
sys.stdout = sys.stderr
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl
from enum import IntEnum

ops_dir = sys.argv[1]
ns = {"torch": torch, "triton": triton, "tl": tl, "IntEnum": IntEnum,
      "next_power_of_2": lambda n: 1 << (n - 1).bit_length() if n > 0 else 1}
wanted = {
    "spec_tree.py": {"TreeMaskMode", "sgl_build_tree_kernel_efficient_triton", "verify_tree_greedy_kernel_triton",
                     "sgl_build_tree_kernel_triton", "verify_tree_greedy_triton"},
    "reconstruct_tree.py": {"_reconstruct_tree_mask_kernel", "_num_warps_for",
                            "reconstruct_indices_from_tree_mask_triton"},
}
for fname, names in wanted.items():
    path = os.path.join(ops_dir, fname)
    tree = ast.parse(open(path).read())
    body = [node for node in tree.body if getattr(node, "name", None) in names]
    assert {node.name for node in body} == names, (path, names)
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)
assert isinstance(ns["verify_tree_greedy_kernel_triton"], triton.runtime.interpreter.InterpretedFunction)

def send(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    out.write(struct.pack("<Q", len(data)) + data)
    out.flush()

send("ready")
while True:
    head = sys.stdin.buffer.read(8)
    if len(head) < 8:
        break
    (size,) = struct.unpack("<Q", head)
    name, args = torch.load(io.BytesIO(sys.stdin.buffer.read(size)))
    if name == "sgl_build_tree_kernel_triton":
        args = list(args[:-1]) + [ns["TreeMaskMode"](args[-1])]
    try:
        ns[name](*args)
        send(("ok", [a for a in args if isinstance(a, torch.Tensor)]))
    except Exception as exc:  # reported to the test
        send(("error", repr(exc)))
"""


def sglang_source_dir() -> Optional[pathlib.Path]:
    """Directory of the installed ``sglang`` package, found without importing it."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


class SGLangTritonKernels:
    """SGLang's Triton tree kernels and their launch wrappers, run by the Triton interpreter.

    The definitions are executed from SGLang's installed source files
    (``kernels/ops/speculative/spec_tree.py`` and ``reconstruct_tree.py``) in a child
    process, without importing the ``sglang`` package (whose import pulls in the server
    stack); the modules' own imports are provided. Calls mutate the given tensors in place,
    as the kernels do.
    """

    def __init__(self, ops_dir: pathlib.Path):
        env = dict(os.environ, TRITON_INTERPRET="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _KERNEL_WORKER, str(ops_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        ready = self._recv()
        if ready != "ready":
            raise RuntimeError(f"kernel worker failed to start: {ready!r}")
        atexit.register(self.close)

    def _recv(self):
        head = self.proc.stdout.read(8)
        if len(head) < 8:
            raise RuntimeError("kernel worker exited")
        (size,) = struct.unpack("<Q", head)
        return torch.load(io.BytesIO(self.proc.stdout.read(size)))

    def call(self, name: str, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        buf = io.BytesIO()
        torch.save((name, [int(a) if isinstance(a, IntEnum) else a for a in args]), buf)
        data = buf.getvalue()
        self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
        self.proc.stdin.flush()
        status, payload = self._recv()
        if status != "ok":
            raise RuntimeError(f"{name} failed in the Triton interpreter: {payload}")
        for mine, theirs in zip(tensors, payload):
            mine.copy_(theirs)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_KERNELS: Optional[SGLangTritonKernels] = None


def sglang_triton_kernels() -> SGLangTritonKernels:
    """The shared :class:`SGLangTritonKernels` (skips the test when SGLang is absent)."""
    global _KERNELS
    if _KERNELS is None:
        root = sglang_source_dir()
        if root is None:
            pytest.skip("SGLang is not installed")
        _KERNELS = SGLangTritonKernels(root / "kernels" / "ops" / "speculative")
    return _KERNELS

"""``--speculative-graft-tp-check``: tree hashes compared across tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from sglang_graft.config import GraftConfig, validate
from sglang_graft.engine.tp_check import TreeDivergenceError, TreeHashCheck, tree_hash


def _tree(seed: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (3 * 8,), generator=gen)
    parents = (torch.rand(3, 8, generator=gen) * torch.arange(8)).long()
    parents[:, 0] = -1
    return tokens, parents, parents >= 0


def _other_rank(tensors):
    """An all-reduce MAX against a second rank that built ``tensors``."""
    def all_reduce_max(local: torch.Tensor) -> None:
        h = int(tree_hash(tensors))
        local.copy_(torch.maximum(local, torch.tensor([h, -h])))
    return all_reduce_max


def test_hash_sees_every_value_position_and_shape():
    tokens, parents, linked = _tree(0)
    base = int(tree_hash((tokens, parents, linked)))
    assert base == int(tree_hash((tokens.clone(), parents.clone(), linked.clone())))
    changed = tokens.clone()
    changed[17] += 1
    swapped = tokens.clone()
    swapped[[0, 1]] = tokens[[1, 0]]
    unlinked = linked.clone()
    unlinked[2, 5] = ~unlinked[2, 5]
    variants = [(changed, parents, linked), (swapped, parents, linked), (tokens, parents, unlinked),
                (tokens.view(3, 8), parents.view(-1)[:23], linked), (parents.reshape(-1), tokens.view(3, 8), linked)]
    hashes = {int(tree_hash(v)) for v in variants}
    assert base not in hashes and len(hashes) == len(variants)


def test_ranks_with_the_same_tree_pass_and_a_drifted_rank_stops_the_server():
    tree = _tree(1)
    same = TreeHashCheck(1, _other_rank(tree))
    for _ in range(5):
        same.step(tree)
    assert same.checks == 5
    drifted = TreeHashCheck(1, _other_rank(_tree(2)))
    with pytest.raises(TreeDivergenceError, match=r"step 1 .*--speculative-graft-tp-check"):
        drifted.step(tree)


def test_checks_run_every_k_steps_and_never_when_off():
    tree, other = _tree(3), _tree(4)
    every3 = TreeHashCheck(3, _other_rank(other))
    every3.step(tree)
    every3.step(tree)
    with pytest.raises(TreeDivergenceError, match="step 3"):
        every3.step(tree)
    off = TreeHashCheck(0, _other_rank(other))
    for _ in range(10):
        off.step(tree)
    assert off.checks == 0


def test_a_negative_interval_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--speculative-graft-tp-check must be >= 0"):
        validate(GraftConfig(tp_check=-1), num_nodes=8, num_steps=3, topk=2)


def test_unset_the_check_runs_every_64_steps_with_tensor_parallelism_and_never_on_one_rank():
    import argparse

    from sglang_graft.config import TP_CHECK_AUTO, add_cli_args, config_from_namespace

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    cfg = config_from_namespace(parser.parse_args([]))
    assert cfg.tp_check is None and TP_CHECK_AUTO == 64
    assert (cfg.resolved_tp_check(1), cfg.resolved_tp_check(2), cfg.resolved_tp_check(8)) == (0, 64, 64)
    explicit = config_from_namespace(parser.parse_args(["--speculative-graft-tp-check", "0"]))
    assert explicit.resolved_tp_check(8) == 0
    assert config_from_namespace(parser.parse_args(["--speculative-graft-tp-check", "3"])).resolved_tp_check(1) == 3
    validate(cfg, num_nodes=8, num_steps=3, topk=2)
    assert "Default: every 64 steps with tensor parallelism, off on one rank." in " ".join(parser.format_help().split())

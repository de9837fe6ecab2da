"""GRAFT's own server flags (``--speculative-graft-*``) and the resolved configuration.

SGLang 0.5.23 builds ``ServerArgs`` from a fixed field list, so a plugin's flags travel beside
it: HookRegistry adds them to the parser (``ServerArgs.add_cli_args``) and copies the parsed
values into a :class:`GraftConfig` before ``ServerArgs.from_cli_args`` resolves the record; the
config rides along on the record as the non-field attribute ``_graft_config`` (pickled to the
scheduler processes with it). Engine users without a CLI get the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

SOURCES = ("sam", "recycle", "auto", "none")
PLACEMENTS = ("root", "deepest_draft")


@dataclass(frozen=True)
class GraftConfig:
    """Everything GRAFT adds to SGLang's speculative flags.

    The verify budget ``N`` is ``--speculative-num-draft-tokens`` (root included); draft depth
    and width are ``--speculative-num-steps`` / ``--speculative-eagle-topk``.
    """

    source: str = "auto"  # where retrieved chains come from, per request
    # Draft depths of the confidence checkpoints; empty = the published (0, 1, 5), clipped to the
    # draft's depth (see ``resolved_checkpoints``).
    checkpoint_depths: Tuple[int, ...] = ()
    thresholds: Tuple[float, ...] = (0.35, 0.25, 0.15)  # c_d below which the draft is cut there
    # Share of the N-1 verify slots kept as draft per stage: the published 8 / 24 / 40 of 60.
    keep_fractions: Tuple[float, ...] = (8 / 60, 24 / 60, 40 / 60)
    min_retrieval_slots: int = 0  # slots reserved for retrieval even when every checkpoint passes
    placement: str = "root"  # where the retrieved tree hangs
    retrieval_max_depth: int = 8  # deepest retrieved chain
    sam_min_match: int = 4  # shortest suffix match the automaton trusts (else the n-gram fallback)
    context_cap: int = 65536  # per-request retrieval context (tokens)
    store_memory_mb: int = 1024  # all per-request stores together
    recycle_k: int = 8  # successors kept per vocabulary token
    recycle_widths: Tuple[int, ...] = (8, 10, 8, 6, 5, 4, 4, 4, 3)  # BFS width template
    auto_match_threshold: int = 4  # auto: suffix match length from which sam is used

    def resolved_checkpoints(self, num_steps: int) -> Tuple[int, ...]:
        """Checkpoint depths for a draft of ``num_steps`` levels (depths 0..num_steps-1)."""
        if self.checkpoint_depths:
            return tuple(self.checkpoint_depths)
        return tuple(sorted({min(d, num_steps - 1) for d in (0, 1, 5)}))

    def keep_per_stage(self, num_nodes: int) -> Tuple[int, ...]:
        """Draft nodes kept at each pruning stage for budget ``N`` (root excluded)."""
        budget = num_nodes - 1
        # a positive share keeps at least one draft node; 0 prunes the draft to the root
        return tuple(min(budget, max(int(f > 0), round(f * budget))) for f in self.keep_fractions)


_FLAGS: dict[str, dict[str, Any]] = {
    "source": dict(choices=SOURCES, help="Retrieval source grafted into freed slots: per-request suffix "
                   "automaton / n-gram store (sam), token-recycling matrix (recycle), per-request choice (auto), "
                   "or none (prune only)."),
    "checkpoint_depths": dict(type=int, nargs="+", help="Draft depths of the confidence checkpoints."),
    "thresholds": dict(type=float, nargs="+", help="Confidence threshold per checkpoint (best path probability)."),
    "keep_fractions": dict(type=float, nargs="+", help="Share of the N-1 verify slots kept for draft nodes "
                           "when pruning stops at each checkpoint (0: prune to the root, retrieval only)."),
    "min_retrieval_slots": dict(type=int, help="Verify slots reserved for retrieval when no checkpoint fails."),
    "placement": dict(choices=PLACEMENTS, help="Graft retrieved chains under the root (published) or under "
                      "the deepest kept draft node (recycle source only)."),
    "retrieval_max_depth": dict(type=int, help="Longest retrieved chain."),
    "sam_min_match": dict(type=int, help="Shortest suffix-automaton match used before the n-gram fallback."),
    "context_cap": dict(type=int, help="Tokens of context each request's retrieval store keeps."),
    "store_memory_mb": dict(type=int, help="Memory cap of all retrieval stores together (MB); LRU eviction."),
    "recycle_k": dict(type=int, help="Successors per vocabulary token in the recycling matrix."),
    "recycle_widths": dict(type=int, nargs="+", help="BFS width template of recycling proposals."),
    "auto_match_threshold": dict(type=int, help="auto source: suffix match length from which sam is used."),
}


def flag_name(name: str) -> str:
    return "--speculative-graft-" + name.replace("_", "-")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``--speculative-graft-*`` flags (defaults from :class:`GraftConfig`)."""
    defaults = GraftConfig()
    group = parser.add_argument_group("GRAFT speculative decoding (sglang-graft)")
    for name, spec in _FLAGS.items():
        default = getattr(defaults, name)
        group.add_argument(flag_name(name), dest="graft_" + name, default=default,
                           **{"help": spec["help"] + f" Default: {default}.", **{k: v for k, v in spec.items() if k != "help"}})


def config_from_namespace(args: argparse.Namespace) -> GraftConfig:
    """The :class:`GraftConfig` of parsed CLI arguments (tuples for list flags)."""
    values = {}
    for f in dataclasses.fields(GraftConfig):
        v = getattr(args, "graft_" + f.name, getattr(GraftConfig(), f.name))
        values[f.name] = tuple(v) if isinstance(v, list) else v
    return GraftConfig(**values)


def validate(cfg: GraftConfig, *, num_draft_tokens: int, num_steps: int, topk: int,
             draft_model_path: Optional[str], page_size: int) -> None:
    """Raise ``ValueError`` with a one-line message naming the offending flag."""
    if not draft_model_path:
        raise ValueError("--speculative-algorithm GRAFT needs --speculative-draft-model-path (an EAGLE-3 head)")
    if cfg.source not in SOURCES:
        raise ValueError(f"{flag_name('source')} must be one of {', '.join(SOURCES)}, got {cfg.source!r}")
    if cfg.placement not in PLACEMENTS:
        raise ValueError(f"{flag_name('placement')} must be one of {', '.join(PLACEMENTS)}, got {cfg.placement!r}")
    if cfg.placement == "deepest_draft" and cfg.source not in ("recycle", "none"):
        raise ValueError(f"{flag_name('placement')} deepest_draft needs {flag_name('source')} recycle "
                         "(the per-request store proposes continuations of the committed context only)")
    depths = cfg.resolved_checkpoints(num_steps)
    n = len(depths)
    if len(cfg.thresholds) < n or len(cfg.keep_fractions) < n or (
        cfg.checkpoint_depths and (len(cfg.thresholds) != n or len(cfg.keep_fractions) != n)
    ):
        raise ValueError(f"{flag_name('checkpoint_depths')}, {flag_name('thresholds')} and "
                         f"{flag_name('keep_fractions')} need the same number of values, got "
                         f"{n}, {len(cfg.thresholds)}, {len(cfg.keep_fractions)}")
    if list(depths) != sorted(set(depths)) or min(depths, default=0) < 0:
        raise ValueError(f"{flag_name('checkpoint_depths')} must be increasing and >= 0, got {list(depths)}")
    if depths and depths[-1] >= num_steps:
        raise ValueError(f"{flag_name('checkpoint_depths')} {list(depths)} needs draft depth "
                         f"{depths[-1]}, but --speculative-num-steps {num_steps} drafts depths 0..{num_steps - 1}")
    if any(not 0.0 <= t <= 1.0 for t in cfg.thresholds):
        raise ValueError(f"{flag_name('thresholds')} must lie in [0, 1], got {list(cfg.thresholds)}")
    if any(not 0.0 <= f <= 1.0 for f in cfg.keep_fractions):
        raise ValueError(f"{flag_name('keep_fractions')} must lie in [0, 1], got {list(cfg.keep_fractions)}")
    if topk < 1:
        raise ValueError(f"--speculative-eagle-topk must be >= 1 for GRAFT, got {topk}")
    max_draft = topk + (num_steps - 1) * topk * topk
    if num_draft_tokens < 2:
        raise ValueError(f"--speculative-num-draft-tokens must be >= 2 for GRAFT, got {num_draft_tokens}")
    if num_draft_tokens - 1 > max_draft:
        raise ValueError(f"--speculative-num-draft-tokens {num_draft_tokens} exceeds what the draft can fill "
                         f"(topk {topk}, steps {num_steps}: at most {max_draft + 1})")
    if cfg.min_retrieval_slots < 0 or cfg.min_retrieval_slots > num_draft_tokens - 2:
        raise ValueError(f"{flag_name('min_retrieval_slots')} must lie in [0, N-2] = [0, {num_draft_tokens - 2}], "
                         f"got {cfg.min_retrieval_slots}")
    for name in ("retrieval_max_depth", "sam_min_match", "context_cap", "store_memory_mb", "recycle_k"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{flag_name(name)} must be >= 1, got {getattr(cfg, name)}")
    if not cfg.recycle_widths or min(cfg.recycle_widths) < 1 or max(cfg.recycle_widths) > cfg.recycle_k * 64:
        raise ValueError(f"{flag_name('recycle_widths')} must be positive, got {list(cfg.recycle_widths)}")
    if page_size != 1:
        raise ValueError(f"GRAFT needs --page-size 1 (its irregular trees use the topk > 1 KV layout), got {page_size}")


def prune_config(cfg: GraftConfig, num_nodes: int, num_steps: int):
    """The tree core's ``PruneConfig`` for budget ``N`` and a ``num_steps``-level draft."""
    from sglang_graft.tree import PruneConfig

    depths = cfg.resolved_checkpoints(num_steps)
    n = len(depths)
    return PruneConfig(checkpoint_depths=depths, thresholds=tuple(cfg.thresholds[:n]),
                       keep_per_stage=cfg.keep_per_stage(num_nodes)[:n],
                       min_retrieval_slots=cfg.min_retrieval_slots)

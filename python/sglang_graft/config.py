"""GRAFT's one algorithm configuration, its ``--speculative-graft-*`` flags and their validation.

No SGLang imports: the serving glue (``sglang_graft.sglang``) adds these flags to SGLang's parser
and carries the parsed :class:`GraftConfig` to every scheduler process on the server-args record.

Names: the verify budget is ``num_nodes`` (``N``, root included) everywhere in this package; on
SGLang's command line it is ``--speculative-num-draft-tokens``. The draft has ``num_steps`` levels
of ``topk`` beams (``--speculative-num-steps`` / ``--speculative-eagle-topk``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from sglang_graft.retrieval import SourceNames
from sglang_graft.tree.types import (
    DEFAULT_THRESHOLDS,
    PAPER_BUDGET,
    PAPER_CHECKPOINT_DEPTHS,
    PAPER_KEEP_PER_STAGE,
    PruneConfig,
    draft_pool_size,
)

# ``--speculative-graft-source`` values: every registered retrieval source (built in: sam, recycle;
# see ``sglang_graft.retrieval.register_source``), then auto and none. A live view of the registry.
SOURCES = SourceNames()
PLACEMENTS = ("root", "deepest_draft")
# Who shares a recycling matrix: everybody, requests with the same tenant key
# (``cache_salt``; a request without one is alone), or nobody.
RECYCLE_SCOPES = ("shared", "tenant", "request")
# How the verify budget is chosen: per step from measured costs and calibrated node values, or fixed.
BUDGET_MODES = ("cost", "fixed")
# --speculative-graft-graph: the tree build, and the draft loop where its depth is known before it runs,
# replayed from captured graphs (on), also checked against eager runs every step (shadow, a test mode),
# eager (off); auto: off until the capture has run inside a served CUDA step (on an H200 it has run
# outside a server: benchmark/results/gpu_h200/)
GRAPH_MODES = ("auto", "on", "off", "shadow")
# Whether the decode step may read device values on the host: ``on`` never (decisions and retrieval
# from results two worker calls old, re-rooted on the device), ``off`` (fresh values, host reads),
# ``auto``: on for CUDA, off on a CPU (where a host read stalls nothing).
SYNC_FREE_MODES = ("auto", "on", "off")
SUFFIX_CHAIN_MODES = ("off", "on")
# --speculative-graft-lagged-depths: the expected tokens by draft depth a sync-free step chooses from:
# the newest known step's alone (newest: it values the depths it drafted and one deeper, so the draft
# deepens by at most one level per known step), or per depth the newest known step that valued it
# (remembered).
LAGGED_DEPTH_MODES = ("newest", "remembered")
# --speculative-graft-request-calibration: each request's own factor on the server-wide calibrated
# acceptance of its draft and retrieved nodes (engine/request_calibration.py), or none (the default:
# it did not pay on the report split, benchmark/RESULTS.md).
REQUEST_CALIBRATION_MODES = ("off", "on")
# --speculative-graft-plain-steps: where a cost-aware step may be decided plain (N = 1, the roots
# verified alone): in batches of two or more requests (batched), in every batch (on), never (off).
PLAIN_STEP_MODES = ("batched", "on", "off")
# --speculative-graft-ragged: a cost-aware step gives each request its own number of verify slots
# (the batch's most valuable nodes) and leaves the unused slots' rows out of the verify (on), or gives
# every request the chosen budget (off); auto: on where a left-out row costs nothing (a CPU target).
RAGGED_MODES = ("auto", "on", "off")
# --speculative-graft-tp-check unset: every this many steps with tensor parallelism (0 on one rank)
TP_CHECK_AUTO = 64


@dataclass(frozen=True)
class GraftConfig:
    """Everything GRAFT adds to SGLang's speculative flags (one field per ``--speculative-graft-*``)."""

    source: str = "auto"  # where retrieved chains come from, per request
    # Draft depths of the confidence checkpoints; empty = the published (0, 1, 5), clipped to the
    # draft's depth (see ``resolved_checkpoints``).
    checkpoint_depths: Tuple[int, ...] = ()
    thresholds: Tuple[float, ...] = DEFAULT_THRESHOLDS  # c_d below which the draft is cut there
    # Share of the N-1 verify slots kept as draft per stage; empty = see ``resolved_keep_fractions``.
    keep_fractions: Tuple[float, ...] = ()
    min_retrieval_slots: int = 0  # slots reserved for retrieval even when every checkpoint passes
    placement: str = "root"  # where the retrieved tree hangs
    retrieval_max_depth: int = 8  # deepest retrieved chain
    sam_min_match: int = 4  # shortest suffix match the automaton trusts (else the n-gram fallback)
    context_cap: int = 65536  # per-request retrieval context (tokens)
    store_memory_mb: int = 1024  # all per-request stores together
    recycle_k: int = 8  # successors kept per vocabulary token
    recycle_widths: Tuple[int, ...] = (8, 10, 8, 6, 5, 4, 4, 4, 3)  # BFS width template
    recycle_scope: str = "tenant"  # who shares a recycling matrix (see RECYCLE_SCOPES)
    auto_match_threshold: int = 4  # auto: suffix match length from which sam is used
    suffix_chain: str = "off"  # sync-free steps' device-side suffix chain (see SUFFIX_CHAIN_MODES)
    lagged_depths: str = "newest"  # which known steps' depth rows a sync-free step chooses from (LAGGED_DEPTH_MODES)
    request_calibration: str = "off"  # per-request factors on the calibrated acceptance (REQUEST_CALIBRATION_MODES)
    per_step_metrics: bool = False  # per verify step GRAFT fields in responses (else aggregates)
    budget_mode: str = "cost"  # cost: per-step budget, draft only what pays; fixed: N every step, every draft pass
    budgets: Tuple[int, ...] = ()  # verify budgets a step may choose; empty: see resolved_budgets
    skip_draft_tokens: float = 3.0  # retrieval alone expects this many accepted tokens: no draft passes
    tp_check: Optional[int] = None  # every K steps compare the verify tree across TP ranks (0: off; None: auto)
    sync_free: str = "auto"  # no host read in the decode step (see SYNC_FREE_MODES)
    # cost mode: where a step whose N = 1 pays best verifies its roots alone (PLAIN_STEP_MODES)
    plain_steps: str = "batched"
    # plain steps defer the draft extend; the draft catches up in one extend within this many (0: never defer;
    # the default: deferring was slower under load on the tuning split, benchmark/RESULTS.md)
    draft_lag: int = 0
    graph: str = "auto"  # the tree build replayed from captured graphs (see GRAPH_MODES)
    ragged: str = "auto"  # per-request verify slots (see RAGGED_MODES)

    def resolved_checkpoints(self, num_steps: int) -> Tuple[int, ...]:
        """Checkpoint depths for a draft of ``num_steps`` levels (depths 0..num_steps-1)."""
        if self.checkpoint_depths:
            return tuple(self.checkpoint_depths)
        return tuple(sorted({min(d, num_steps - 1) for d in PAPER_CHECKPOINT_DEPTHS}))

    def resolved_keep_fractions(self) -> Tuple[float, ...]:
        """Per-stage draft share of the ``N - 1`` slots: as given; unset, the published 8 / 24 / 40
        of 60 with the fixed budget, and no cap (1.0) with the cost-aware one, whose value
        ranking then alone decides how many draft nodes a tree keeps (the published split as a
        cap made the cost-aware step slower; the README's "Running GRAFT" section has the run)."""
        if self.keep_fractions:
            return self.keep_fractions
        if self.budget_mode == "fixed":
            return tuple(k / PAPER_BUDGET for k in PAPER_KEEP_PER_STAGE)
        return (1.0,) * len(PAPER_KEEP_PER_STAGE)

    def resolved_budgets(self, num_nodes: int) -> Tuple[int, ...]:
        """Verify budgets a step may use (ascending, ending at ``num_nodes``, the largest);
        ``fixed`` mode: only ``num_nodes``. By default the powers of two below ``num_nodes``, 1.5 times
        each from 8 on (where a verify's rows fill the CPU kernels' 12-row blocks, 12 rows cost about
        what 8 do), and ``num_nodes``.

        Example: ``N = 16`` gives ``(1, 2, 4, 8, 12, 16)``; ``N = 12`` gives ``(1, 2, 4, 8, 12)``;
        ``N = 32`` gives ``(1, 2, 4, 8, 12, 16, 24, 32)``.

        Chosen on spec_bench's tune split (SmolLM2-135M, batch 1, AVX-512 Xeon): adding 12 to
        ``(1, 2, 4, 8, 16)`` took GRAFT from 1.67x to 1.73x no speculation, every category alike or
        faster, N = 12 chosen in 68 % of steps (``benchmark/results/smollm2_tune_budget12_avx512.md``);
        on an AVX2 host (4-row blocks) it had made no clear difference (1.33x against 1.30x, the same tau).
        """
        if self.budget_mode == "fixed":
            return (num_nodes,)
        if self.budgets:
            return tuple(sorted(set(self.budgets)))
        out = {num_nodes}
        b = 1
        while b < num_nodes:
            out.add(b)
            if b >= 8 and b * 3 // 2 < num_nodes:
                out.add(b * 3 // 2)
            b *= 2
        return tuple(sorted(out))

    def prune_config(self, num_nodes: int, num_steps: int) -> PruneConfig:
        """The tree core's :class:`PruneConfig` for budget ``N`` and a ``num_steps``-level draft.

        A stage keeps ``round(fraction * (N - 1))`` draft nodes, at least one for a positive
        fraction (0 prunes the draft to the root); a cost-aware step keeps at most that many.
        Example: the fixed budget's default fractions at ``N = 61`` keep 8 / 24 / 40 of the 60
        non-root slots, the paper's split; at ``N = 16`` 2 / 6 / 10.
        """
        depths = self.resolved_checkpoints(num_steps)
        n = len(depths)
        slots = num_nodes - 1
        keep = tuple(min(slots, max(int(f > 0), round(f * slots))) for f in self.resolved_keep_fractions()[:n])
        return PruneConfig(checkpoint_depths=depths, thresholds=tuple(self.thresholds[:n]),
                           keep_per_stage=keep, min_retrieval_slots=self.min_retrieval_slots)

    def resolved_graph(self) -> str:
        """``--speculative-graft-graph`` as the step runs it: ``on``, ``shadow`` or ``off``
        (``auto`` is ``off`` on every device for now: on a CPU the capture runs through the
        stand-in, and on CUDA it has run outside a server only, not in a served step)."""
        return "off" if self.graph == "auto" else self.graph

    def resolved_ragged(self, device, sync_free: bool) -> bool:
        """Whether a cost-aware step sizes each request's tree on its own (``auto``: on a CPU, where
        the CPU port leaves the unused slots' rows out of the verify; never with the fixed budget or
        sync-free steps, whose budget is decided for the batch)."""
        if self.budget_mode != "cost" or sync_free:
            return False
        if self.ragged == "auto":
            return torch.device(device).type == "cpu"
        return self.ragged == "on"

    def resolved_tp_check(self, tp_size: int) -> int:
        """Steps between cross-rank tree checks (0: none): as given, else every
        :data:`TP_CHECK_AUTO` steps with tensor parallelism and never on one rank (nothing to
        compare). A check is one host read and an all-reduce of two integers; every 64 steps it
        bounds how long ranks whose trees drifted apart can write different KV before the server
        stops, at a cost no step can feel (``benchmark/RESULTS.md`` has the measurement)."""
        if self.tp_check is not None:
            return self.tp_check
        return TP_CHECK_AUTO if tp_size > 1 else 0

    def resolved_sync_free(self, device) -> bool:
        """Whether the decode step runs without host reads on ``device`` (``auto``: on CUDA, unless
        the placement or per-step metrics need host reads)."""
        if self.sync_free == "auto":
            return torch.device(device).type == "cuda" and self.placement == "root" and not self.per_step_metrics
        return self.sync_free == "on"


_FLAGS: dict[str, dict[str, Any]] = {
    "source": dict(choices=SOURCES, help="Retrieval source grafted into freed slots: per-request suffix "
                   "automaton / n-gram store (sam), token-recycling matrix (recycle), any other registered source, "
                   "per-request choice between sam and recycle (auto), or none (prune only)."),
    "checkpoint_depths": dict(type=int, nargs="+", help="Draft depths of the confidence checkpoints."),
    "thresholds": dict(type=float, nargs="+", help="Confidence threshold per checkpoint (best path probability)."),
    "keep_fractions": dict(type=float, nargs="+", help="Share of the N-1 verify slots kept for draft nodes "
                           "when pruning stops at each checkpoint (0: prune to the root, retrieval only); a cap on "
                           "the cost-aware split. Default: 8/60 24/60 40/60 with --speculative-graft-budget-mode fixed, "
                           "no cap with cost."),
    "min_retrieval_slots": dict(type=int, help="Verify slots reserved for retrieval when no checkpoint fails."),
    "placement": dict(choices=PLACEMENTS, help="Graft retrieved chains under the root (published) or under "
                      "the deepest kept draft node (recycle source only)."),
    "retrieval_max_depth": dict(type=int, help="Longest retrieved chain."),
    "sam_min_match": dict(type=int, help="Shortest suffix-automaton match used before the n-gram fallback."),
    "context_cap": dict(type=int, help="Tokens of context each request's retrieval store keeps."),
    "store_memory_mb": dict(type=int, help="Memory cap of all retrieval stores together (MB); LRU eviction."),
    "recycle_k": dict(type=int, help="Successors per vocabulary token in the recycling matrix."),
    "recycle_widths": dict(type=int, nargs="+", help="BFS width template of recycling proposals."),
    "recycle_scope": dict(choices=RECYCLE_SCOPES, help="Who shares a recycling matrix: all requests (shared), "
                          "requests with the same cache_salt (tenant; a request without one is "
                          "alone), or each request alone (request). Learned from verify logits, a shared matrix "
                          "lets one request's proposals depend on another's content."),
    "auto_match_threshold": dict(type=int, help="auto source: suffix match length from which sam is used."),
    "budget_mode": dict(choices=BUDGET_MODES, help="cost: each step picks the verify budget (from --speculative-graft-"
                   "budgets) with the most expected committed tokens per second, from costs measured on this device "
                   "and node acceptance calibrated online, and drafts deeper only while it pays; fixed: "
                   "--speculative-num-draft-tokens every step, every draft pass (reproducible comparisons)."),
    "budgets": dict(type=int, nargs="+", help="Verify budgets (root included) a step may choose in cost mode; the "
                    "largest must be --speculative-num-draft-tokens (default: the powers of two below it, 1.5 times "
                    "each from 8 (12, 24, ...), and it). "
                    "Budget 1 is a plain decode step."),
    "skip_draft_tokens": dict(type=float, help="cost mode: a request whose retrieved tree alone is expected to "
                              "have this many tokens accepted needs no draft pass."),
    "tp_check": dict(type=int, help="Every K verify steps, all-reduce a hash of the tree over the tensor-parallel "
                     "ranks and stop with an error if they differ (0 = off; each check is one host sync). "
                     f"Default: every {TP_CHECK_AUTO} steps with tensor parallelism, off on one rank."),
    "suffix_chain": dict(choices=SUFFIX_CHAIN_MODES, help="on: sync-free cost-aware steps whose sources include "
                         "sam also propose, per request, the chain after the most recent longest match of its newest "
                         "committed tokens, found on the device (the host store lags two steps there); off: they do "
                         "not (the default: on the tune split it moved tau between categories, 2.28 either way)."),
    "lagged_depths": dict(choices=LAGGED_DEPTH_MODES, help="Sync-free cost-aware steps choose draft passes, budget "
                          "and plain steps from each known step's expected tokens per budget by draft depth, valued "
                          "for the depths it drafted and estimated one level deeper. newest: from the newest known "
                          "step alone (the draft deepens by at most one level per known step); remembered: each "
                          "depth from the newest known step that valued it."),
    "request_calibration": dict(choices=REQUEST_CALIBRATION_MODES, help="Cost mode: on: each request's draft "
                                "and retrieved nodes are valued at the server-wide calibrated acceptance times the "
                                "request's own ratio of accepted to expected tokens so far, at most 1 (draft and "
                                "retrieved nodes apart, 8 expected tokens of prior), so a request whose candidates "
                                "are accepted less often than the server's stops paying for them; off: server-wide "
                                "only (the default: on the report split it was slower, RESULTS.md)."),
    "sync_free": dict(choices=SYNC_FREE_MODES, help="on: the decode step reads no device value on the host "
                      "(retrieval, draft depth and budget decided from results two steps old, retrieved trees "
                      "re-rooted on the device along the newest committed path; responses carry no per-request "
                      "GRAFT counts); off: fresh values, a few host reads per step; auto: on for CUDA (unless "
                      "--speculative-graft-placement deepest_draft or --speculative-graft-per-step-metrics), off on a CPU."),
    "plain_steps": dict(choices=PLAIN_STEP_MODES, help="Cost-aware budget: when, valued after retrieval at the "
                        "draft's first level, budget 1 priced as a plain decode step pays best and no draft pass "
                        "would, the step is a plain decode step (the roots verified alone; no draft pass, tree or "
                        "feed). batched: in batches of 2 or more requests (on the tuning prompts under load "
                        "faster than off; at batch 1 it was not); on: in every batch; off: never. Sync-free steps "
                        "decide it with their draft depth and budget from the valuation of a step two calls old."),
    "draft_lag": dict(type=int, help="Plain steps skip SGLang's draft extend and keep the committed token and its "
                      "target hidden state instead; the draft catches up on them in one extend, in a later plain "
                      "step: the one before the step speculates again, or one whose requests are this many steps "
                      "behind. The draft's KV and state are complete before it drafts again. 0: every plain step "
                      "extends the draft, as SGLang does (the default: under load on the tuning prompts deferring "
                      "was slower, the catch-up costing what the skipped extends did)."),
    "graph": dict(choices=GRAPH_MODES, help="on: build each step's tree (prune, graft, flatten, mask) by replaying "
                  "a graph captured per budget, batch-size bucket and input shapes (CUDA graphs on CUDA, a stand-in "
                  "with CUDA-graph semantics on a CPU), and, where the draft depth is known before the draft (the "
                  "fixed budget, sync-free steps), run the draft loop from a graph per bucket and depth (on a CPU; "
                  "eager on CUDA and with tensor parallelism); shadow: on, and each replay checked against an "
                  "eager run (a test mode, host reads); off: eager; auto: off (no capture has run on a GPU yet)."),
    "ragged": dict(choices=RAGGED_MODES, help="Cost-aware budget: on: the chosen budget N sets the batch's verify "
                   "rows (batch size x N), shared out among the requests by node value, so a request with confident "
                   "candidates gets more slots than one without (each at most --speculative-num-draft-tokens); the "
                   "slots a request does not use are padding whose rows the CPU port leaves out of the verify "
                   "forward. off: every request gets N slots. auto: on with a CPU target. Not with sync-free steps. "
                   "With a DFlash block draft: on verifies each request's root, kept prefix and grafted chain only "
                   "(the pruned draft tokens past the chain are left out; a CPU target only), auto the same in "
                   "batches of two or more requests on a CPU, off the whole block."),
    "per_step_metrics": dict(action=argparse.BooleanOptionalAction, help="Report GRAFT's counts per verify step "
                             "in each response's meta_info (per-step acceptance patterns can fingerprint content); "
                             "by default responses carry per-request totals."),
}


def flag_name(name: str) -> str:
    """``checkpoint_depths`` -> ``--speculative-graft-checkpoint-depths``."""
    return "--speculative-graft-" + name.replace("_", "-")


# The flags by who needs them (the --help groups and docs/flags.md's tables, checked by a test).
FLAG_GROUPS: dict[str, tuple[str, ...]] = {
    "production: the flags that matter on a GPU": ("source", "budget_mode", "budgets", "sync_free", "plain_steps",
                                                   "tp_check", "recycle_scope", "context_cap", "store_memory_mb",
                                                   "graph"),
    "algorithm tuning (defaults chosen on the tune split)": (
        "checkpoint_depths", "thresholds", "keep_fractions", "min_retrieval_slots", "placement",
        "retrieval_max_depth", "sam_min_match", "recycle_k", "recycle_widths", "auto_match_threshold",
        "skip_draft_tokens", "suffix_chain", "lagged_depths", "request_calibration"),
    "steps a CPU takes (off with sync-free steps, so off on CUDA by default)": ("ragged", "draft_lag"),
    "testing and diagnostics": ("per_step_metrics",),
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``--speculative-graft-*`` flags (defaults from :class:`GraftConfig`), in the help
    under one group per :data:`FLAG_GROUPS` entry."""
    defaults = GraftConfig()
    for title, names in FLAG_GROUPS.items():
        group = parser.add_argument_group(f"GRAFT speculative decoding, {title}")
        for name in names:
            spec, default = _FLAGS[name], getattr(defaults, name)
            extra = {k: v for k, v in spec.items() if k != "help"}
            group.add_argument(flag_name(name), dest="graft_" + name, default=default,
                               help=spec["help"] if "Default:" in spec["help"] else spec["help"] + f" Default: {default}.",
                               **extra)


def config_from_namespace(args: argparse.Namespace) -> GraftConfig:
    """The :class:`GraftConfig` of parsed CLI arguments (tuples for list flags)."""
    return config_from_dict({f.name: getattr(args, "graft_" + f.name, getattr(GraftConfig(), f.name))
                             for f in dataclasses.fields(GraftConfig)})


def config_from_dict(values: dict[str, Any]) -> GraftConfig:
    """A :class:`GraftConfig` from field values (lists become tuples), e.g. ``dataclasses.asdict``'s."""
    return GraftConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


KWARG_PREFIX = "speculative_graft_"  # sgl.Engine(speculative_graft_source="sam", ...)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit the Python program
        raise ValueError(message)


def config_from_kwargs(kwargs: dict[str, Any]) -> GraftConfig:
    """The :class:`GraftConfig` of ``sgl.Engine`` keyword arguments, parsed as the CLI parses the
    flags of the same names (types, choices, lists): ``speculative_graft_budgets=[1, 4, 16]`` is
    ``--speculative-graft-budgets 1 4 16``; a bool flag takes ``True`` / ``False``; ``None`` is the
    default. An unknown ``speculative_graft_*`` name raises ``TypeError``, a bad value
    ``ValueError``, each naming the keyword."""
    parser = _RaisingParser(add_help=False)
    add_cli_args(parser)
    argv: list[str] = []
    for key, value in kwargs.items():
        name = key[len(KWARG_PREFIX):] if key.startswith(KWARG_PREFIX) else None
        if name not in _FLAGS:
            raise TypeError(f"unexpected keyword argument {key!r}; GRAFT's are "
                            + ", ".join(KWARG_PREFIX + n for n in _FLAGS))
        if value is None:
            continue
        flag = flag_name(name)
        if _FLAGS[name].get("action") is argparse.BooleanOptionalAction:
            if not isinstance(value, bool):
                raise ValueError(f"{key}={value!r}: expected True or False")
            tokens = [flag if value else "--no-" + flag[2:]]
        else:
            tokens = [flag, *map(str, value if isinstance(value, (list, tuple)) else [value])]
        try:
            parser.parse_args(tokens)  # alone: the error names this keyword
        except ValueError as e:
            raise ValueError(f"{key}={value!r}: {e}") from None
        argv += tokens
    return config_from_namespace(parser.parse_args(argv))


def validate(cfg: GraftConfig, *, num_nodes: int, num_steps: int, topk: int) -> None:
    """Raise ``ValueError`` with a one-line message naming the offending flag.

    ``num_nodes`` may exceed what the draft can fill (``draft_pool_size + 1``): the slots
    the draft cannot fill are grafted (a chain draft, ``topk = 1``, fills ``num_steps``).
    """
    for name, spec in _FLAGS.items():  # every flag with choices, from the table that defines the CLI
        choices = spec.get("choices")
        if choices is not None and getattr(cfg, name) not in choices:
            raise ValueError(f"{flag_name(name)} must be one of {', '.join(choices)}, got {getattr(cfg, name)!r}")
    _validate_modes(cfg, num_nodes)
    if cfg.draft_lag < 0:
        raise ValueError(f"{flag_name('draft_lag')} must be >= 0 (0 = the draft extends after every plain step), "
                         f"got {cfg.draft_lag}")
    if cfg.tp_check is not None and cfg.tp_check < 0:
        raise ValueError(f"{flag_name('tp_check')} must be >= 0 (0 = off), got {cfg.tp_check}")
    if cfg.skip_draft_tokens < 0:
        raise ValueError(f"{flag_name('skip_draft_tokens')} must be >= 0, got {cfg.skip_draft_tokens}")
    if cfg.placement == "deepest_draft" and cfg.source not in ("recycle", "none"):
        raise ValueError(f"{flag_name('placement')} deepest_draft needs {flag_name('source')} recycle "
                         "(the per-request store proposes continuations of the committed context only)")
    if num_steps < 1:
        raise ValueError(f"--speculative-num-steps must be >= 1 for GRAFT, got {num_steps}")
    if topk < 1:
        raise ValueError(f"--speculative-eagle-topk must be >= 1 for GRAFT, got {topk}")
    if num_nodes < 2:
        raise ValueError(f"--speculative-num-draft-tokens must be >= 2 for GRAFT, got {num_nodes}")
    depths = cfg.resolved_checkpoints(num_steps)
    n = len(depths)
    keep_fractions = cfg.resolved_keep_fractions()
    if len(cfg.thresholds) < n or len(keep_fractions) < n or (
        cfg.checkpoint_depths and (len(cfg.thresholds) != n or len(keep_fractions) != n)
    ):
        raise ValueError(f"{flag_name('checkpoint_depths')}, {flag_name('thresholds')} and "
                         f"{flag_name('keep_fractions')} need the same number of values, got "
                         f"{n}, {len(cfg.thresholds)}, {len(keep_fractions)}")
    if list(depths) != sorted(set(depths)) or min(depths, default=0) < 0:
        raise ValueError(f"{flag_name('checkpoint_depths')} must be increasing and >= 0, got {list(depths)}")
    if depths and depths[-1] >= num_steps:
        raise ValueError(f"{flag_name('checkpoint_depths')} {list(depths)} needs draft depth "
                         f"{depths[-1]}, but --speculative-num-steps {num_steps} drafts depths 0..{num_steps - 1}")
    if any(not 0.0 <= t <= 1.0 for t in cfg.thresholds):
        raise ValueError(f"{flag_name('thresholds')} must lie in [0, 1], got {list(cfg.thresholds)}")
    if any(not 0.0 <= f <= 1.0 for f in keep_fractions):
        raise ValueError(f"{flag_name('keep_fractions')} must lie in [0, 1], got {list(keep_fractions)}")
    if cfg.min_retrieval_slots < 0 or cfg.min_retrieval_slots > num_nodes - 2:
        raise ValueError(f"{flag_name('min_retrieval_slots')} must lie in [0, N-2] = [0, {num_nodes - 2}], "
                         f"got {cfg.min_retrieval_slots}")
    if cfg.source == "none" and num_nodes - 1 > draft_pool_size(topk, num_steps):
        raise ValueError(f"--speculative-num-draft-tokens {num_nodes} exceeds what the draft can fill "
                         f"(topk {topk}, steps {num_steps}: at most {draft_pool_size(topk, num_steps) + 1}) "
                         f"and {flag_name('source')} none grafts nothing into the rest")
    for name in ("retrieval_max_depth", "sam_min_match", "context_cap", "store_memory_mb", "recycle_k"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{flag_name(name)} must be >= 1, got {getattr(cfg, name)}")
    if not cfg.recycle_widths or min(cfg.recycle_widths) < 1:
        raise ValueError(f"{flag_name('recycle_widths')} must be positive, got {list(cfg.recycle_widths)}")
    from sglang_graft.retrieval.recycling_matrix import build_template

    try:
        build_template(cfg.recycle_widths, cfg.recycle_k)
    except ValueError as e:
        raise ValueError(f"{flag_name('recycle_widths')} {list(cfg.recycle_widths)} with "
                         f"{flag_name('recycle_k')} {cfg.recycle_k}: {e}") from None


def _validate_modes(cfg: GraftConfig, num_nodes: int) -> None:
    """:func:`validate`'s checks of flags that need one another (a mode that needs another flag's value)."""
    if cfg.budget_mode == "cost" and cfg.placement != "root":
        raise ValueError(f"{flag_name('placement')} {cfg.placement} needs {flag_name('budget_mode')} fixed "
                         "(cost-aware steps retrieve under the root, before the draft)")
    if cfg.budgets and (min(cfg.budgets) < 1 or max(cfg.budgets) != num_nodes):
        raise ValueError(f"{flag_name('budgets')} must be >= 1 and end at --speculative-num-draft-tokens "
                         f"{num_nodes}, got {list(cfg.budgets)}")
    if cfg.sync_free == "on" and cfg.placement != "root":
        raise ValueError(f"{flag_name('sync_free')} on needs {flag_name('placement')} root (retrieval under a "
                         "draft node is proposed after the draft, from a host read)")
    if cfg.sync_free == "on" and cfg.per_step_metrics:
        raise ValueError(f"{flag_name('per_step_metrics')} reads each step's counts on the host; it needs "
                         f"{flag_name('sync_free')} off")
    if cfg.graph in ("on", "shadow") and cfg.placement != "root":
        raise ValueError(f"{flag_name('graph')} {cfg.graph} needs {flag_name('placement')} root (retrieval under a "
                         "draft node is proposed inside the tree build, from a host read)")
    if cfg.ragged == "on" and (cfg.budget_mode != "cost" or cfg.sync_free == "on"):
        raise ValueError(f"{flag_name('ragged')} on needs {flag_name('budget_mode')} cost and "
                         f"{flag_name('sync_free')} off or auto (the budget is shared out by each step's node values)")
    if cfg.request_calibration == "on" and cfg.budget_mode != "cost":
        raise ValueError(f"{flag_name('request_calibration')} on needs {flag_name('budget_mode')} cost (the fixed "
                         "budget does not value nodes)")


def resolve_draft_shape(num_steps: Optional[int], topk: Optional[int], num_nodes: Optional[int],
                        defaults: Tuple[int, int, int]) -> Tuple[int, int, int]:
    """``(num_steps, topk, num_nodes)`` with unset values taken from ``defaults``; an unset budget
    is the default capped to what the draft fills plus the root."""
    steps = defaults[0] if num_steps is None else num_steps
    k = defaults[1] if topk is None else topk
    n = num_nodes if num_nodes is not None else min(defaults[2], draft_pool_size(k, steps) + 1)
    return steps, k, n

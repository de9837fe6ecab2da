"""GRAFT's Prometheus counters (with ``--enable-metrics``), next to SGLang's ``sglang:*`` metrics.

They are created in the scheduler process where SGLang's scheduler exports its own metrics (the
rank with attention-TP rank 0 and context-parallel rank 0, or every rank with
``--enable-metrics-for-all-schedulers``), with the labels of SGLang's scheduler metrics
(``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, ``dp_rank`` where
set, ``--extra-metric-labels``): at ``--tp-size 8`` a step is counted once, not 8 times, and a
dashboard that groups SGLang's series by model groups GRAFT's alike. SGLang runs prometheus_client
in multiprocess mode, so the HTTP server's ``/metrics`` exports them with the rest.

Acceptance rate from ``/metrics``: ``sum(sglang:graft_accepted_tokens_total) /
sum(sglang:graft_proposed_tokens_total)``; accepted tokens per verify step (the accept length minus
the bonus token): ``sum(sglang:graft_accepted_tokens_total) / sglang:graft_verify_steps_total``.
"""

from __future__ import annotations

from typing import Optional

from sglang_graft.sglang import seams


class GraftPrometheus:
    """Counters of proposed and accepted tokens (by source), verify steps and pruning stages."""

    def __init__(self, labels: dict[str, str]) -> None:
        from prometheus_client import Counter

        self.labels = labels
        names = list(labels)
        self.accepted = Counter("sglang:graft_accepted_tokens", "Accepted draft-tree tokens by source "
                                "(draft: proposed by the EAGLE-3 draft; retrieval: proposed by retrieval only)",
                                [*names, "source"])
        self.proposed = Counter("sglang:graft_proposed_tokens", "Tree nodes verified past the root", names)
        self.steps = Counter("sglang:graft_verify_steps", "GRAFT verify steps (one per request)", names)
        self.stages = Counter("sglang:graft_pruning_stage", "Verify steps per pruning stage", [*names, "stage"])

    def record(self, drafted: int, retrieved: int, proposed: int, stages: list[int]) -> None:
        self.accepted.labels(**self.labels, source="draft").inc(drafted)
        self.accepted.labels(**self.labels, source="retrieval").inc(retrieved)
        self.proposed.labels(**self.labels).inc(proposed)
        self.steps.labels(**self.labels).inc(len(stages))
        for s in stages:
            self.stages.labels(**self.labels, stage=str(s)).inc()


def scheduler_labels(server_args) -> Optional[dict[str, str]]:
    """The labels of SGLang's scheduler metrics in this process, or None where this rank exports
    none (SGLang 0.5.23, ``SchedulerMetricsCollector.init_new``; GRAFT refuses PD disaggregation and
    DP attention, so the engine type is SGLang's for a unified server)."""
    observability = seams.OBSERVABILITY_CONFIG.resolve()()
    parallel = seams.PARALLEL_CONFIG.resolve()()
    if not observability.enable_metrics:
        return None
    if not ((parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0)
            or observability.enable_metrics_for_all_schedulers):
        return None
    mode = seams.DISAGGREGATION_MODE.resolve()
    labels = {"model_name": server_args.served_model_name,
              "engine_type": mode.to_engine_type(server_args.disaggregation_mode),
              "tp_rank": parallel.tp_rank, "pp_rank": parallel.pp_rank, "moe_ep_rank": parallel.moe_ep_rank}
    if parallel.dp_rank is not None:
        labels["dp_rank"] = parallel.dp_rank
    labels.update(observability.extra_metric_labels or {})
    return {k: str(v) for k, v in labels.items()}


def maybe_prometheus(server_args) -> Optional[GraftPrometheus]:
    labels = scheduler_labels(server_args)
    return GraftPrometheus(labels) if labels is not None else None

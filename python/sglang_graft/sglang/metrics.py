"""GRAFT's Prometheus counters (with ``--enable-metrics``), next to SGLang's ``sglang:*`` metrics.

They are created in the scheduler process; SGLang runs prometheus_client in multiprocess mode, so
the HTTP server's ``/metrics`` exports them with the rest.
"""

from __future__ import annotations

from typing import Optional


class GraftPrometheus:
    """Counters of accepted tokens by source, verify steps, and pruning stages."""

    def __init__(self) -> None:
        from prometheus_client import Counter

        self.accepted = Counter("sglang:graft_accepted_tokens", "Accepted draft-tree tokens by source "
                                "(draft: proposed by the EAGLE-3 draft; retrieval: proposed by retrieval only)",
                                ["source"])
        self.steps = Counter("sglang:graft_verify_steps", "GRAFT verify steps (one per request)")
        self.stages = Counter("sglang:graft_pruning_stage", "Verify steps per pruning stage", ["stage"])

    def record(self, drafted: int, retrieved: int, stages: list[int]) -> None:
        self.accepted.labels(source="draft").inc(drafted)
        self.accepted.labels(source="retrieval").inc(retrieved)
        self.steps.inc(len(stages))
        for s in stages:
            self.stages.labels(stage=str(s)).inc()


def maybe_prometheus(server_args) -> Optional[GraftPrometheus]:
    return GraftPrometheus() if getattr(server_args, "enable_metrics", False) else None

"""Study hook: every GRAFT decode step plain, to time a plain step against a decode step.

With ``PYTHONPATH=benchmark/studies/all_plain:$PYTHONPATH`` the rate guard says speculation loses in
every batch-size bucket with no probe (``RateGuard.plain_now`` always true), so a server run with
``--speculative-graft-plain-steps on`` verifies the roots alone at every step but its exploring ones
(the root, no draft pass, no tree). Outputs stay token-exact. Not for serving.
"""

try:
    from sglang_graft.engine import rate_guard

    rate_guard.RateGuard.plain_now = lambda self, bs: True
except ImportError:  # a process without the package
    pass

"""A step-cost table pinned for served tests that assert what the cost-aware step chose.

The cost-aware budget learns each step's cost from wall-clock time, so on a loaded machine a server
chooses other verify budgets and draft depths (and so commits other numbers of tokens per step)
than on an idle one. A test asserting accept lengths, budgets or draft passes serves with this
table instead: :func:`pinned_env` puts a ``sitecustomize`` on the server's ``PYTHONPATH`` that
replaces ``StepCost.step`` (the prediction every decision reads) with :data:`TABLE`'s linear
model, and gives the rate guard (``RateGuard``, which compares realized tokens per second of plain
and speculative steps) no timed steps, so it never makes a step plain. The learned tables are still
measured and published; only the decisions stop reading them. Outputs are token-exact either way;
what changes is that the same prompts give the same choices on any machine.

``slow_verify`` multiplies every measured verify phase by a factor and adds :data:`SLOW_FLOOR_S`
(a loaded machine slows the target's forward more than the host's bookkeeping): with everything
pinned the decisions must not change (``test_graft_server.py`` checks it; the floor lets it see
that the slowdown reached the step's clock without comparing two runs' loads).
"""

from __future__ import annotations

import os
from pathlib import Path

# Seconds: a step of ``bs`` requests verifying ``N`` nodes each after ``passes`` draft passes costs
# fixed * bs + passes * (pass + pass_per_request * bs) + verify + verify_per_token * bs * N
# (a plain step: no fixed part; the batch's context is not priced)
# (about a tiny float32 model's shape on 2 CPU cores: a draft pass a quarter of a 1-token verify).
TABLE = {"fixed": 0.002, "pass": 0.010, "pass_per_request": 0.002, "verify": 0.040, "verify_per_token": 0.003}

SLOW_FLOOR_S = 0.25  # added to every slowed verify phase

_SHIM = '''
SLOW_FLOOR_S = {floor!r}


def _pin_step_costs(t={table!r}):
    from sglang_graft.engine import budget, rate_guard, step_timer

    def step(self, *, bs, num_nodes, passes, plain=False, context=0):
        return ((0.0 if plain else t["fixed"] * bs) + passes * (t["pass"] + t["pass_per_request"] * bs)
                + t["verify"] + t["verify_per_token"] * bs * num_nodes)

    budget.StepCost.step = step
    rate_guard.RateGuard.observe = lambda self, **step: None

    if {slow_verify!r} != 1.0:
        close = step_timer.StepTimer._close

        def slowed(self, times, total):  # x factor, plus a floor a check can see whatever the load
            extra = times.get("verify", 0.0) * ({slow_verify!r} - 1.0) + SLOW_FLOOR_S
            times["verify"] = times.get("verify", 0.0) + extra
            return close(self, times, total + extra)

        step_timer.StepTimer._close = slowed


_pin_step_costs()
'''


def pinned_source(slow_verify: float = 1.0) -> str:
    """The ``sitecustomize`` source that pins (for a test that writes its own ``sitecustomize``:
    Python imports only the first one on the path)."""
    return _SHIM.format(table=TABLE, slow_verify=float(slow_verify), floor=SLOW_FLOOR_S)


def pinned_env(directory: Path, slow_verify: float = 1.0) -> dict:
    """Environment entries serving with :data:`TABLE` and no rate guard (a ``sitecustomize`` written
    to ``directory``), to merge into a server's or a benchmark driver's environment; measured verify
    phases ``slow_verify`` times slower."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(pinned_source(slow_verify))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)}

"""GRAFT's engine: the per-step decisions and the state they learn from, SGLang-free.

* ``step``: :class:`~sglang_graft.engine.step.GraftStepper`, a decode step's decisions (draft
  depth, verify budget, tree);
* ``plans``: what they fill in (a speculative or a plain step's plan) and the step economy's counters;
* ``retrieval_state``: each request's retrieval stores and the recycling matrix, fed by the worker;
* ``budget``: the acceptance calibration, the step cost model and the budget rule;
  ``request_calibration``: each request's own factors on the calibrated acceptance;
  ``step_timer``: a step's phase times, which the cost model learns from;
* ``lagged``: the sync-free step's commit ring (results reach the host two calls later; committed
  tokens reach the device context of the ``suffix_chain`` source at once);
* ``tp_check``: tree hashes compared across tensor-parallel ranks;
* ``tree_graph``: the tree build replayed from captured graphs (``--speculative-graft-graph``).

May import ``sglang_graft.tree``, ``sglang_graft.retrieval``, ``sglang_graft.config``,
``sglang_graft.graphs`` and ``sglang_graft.kernels``; never SGLang or ``sglang_graft.sglang`` (test/test_layers.py).
"""

"""GRAFT's options as keyword arguments of ``sgl.Engine``.

``sgl.Engine(**kwargs)`` builds its server args as ``self.server_args_class(**kwargs)``, after it
has loaded the plugins; ``ServerArgs`` has no field for a plugin's flags, so
``speculative_graft_source="sam"`` would raise ``TypeError``. GRAFT sets ``server_args_class`` (an
extension point SGLang gives Engine subclasses) to a factory that takes the
``speculative_graft_*`` keywords off, parses them as the CLI parses the flags of the same names
(:func:`sglang_graft.config.config_from_kwargs`), makes that the launch's config
(:func:`launch_config.set_config`, which the processes the Engine starts read as well) and builds the
server args SGLang would have built from the rest::

    sgl.Engine(model_path=..., speculative_algorithm="GRAFT", speculative_draft_model_path=...,
               speculative_graft_source="sam", speculative_graft_budgets=[1, 4, 16])
"""

from __future__ import annotations

import sys

from sglang_graft import config as graft_config
from sglang_graft.sglang import seams
from sglang_graft.sglang.launch_config import set_config


def install() -> None:
    """Wrap ``Engine.server_args_class`` once, where the Engine module is loaded (the process that
    builds an Engine or serves HTTP; the schedulers it starts build none)."""
    if seams.ENGINE_SERVER_ARGS.owner.rsplit(".", 1)[0] not in sys.modules:
        return
    make = seams.ENGINE_SERVER_ARGS.resolve()
    if getattr(make, "graft_keywords", False):
        return
    engine = seams.ENGINE_SERVER_ARGS.resolve_owner()

    def server_args(**kwargs):
        graft = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith(graft_config.KWARG_PREFIX)}
        set_config(graft_config.config_from_kwargs(graft))
        return make(**kwargs)

    server_args.graft_keywords = True
    engine.server_args_class = staticmethod(server_args)

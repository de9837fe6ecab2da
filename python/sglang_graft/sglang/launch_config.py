"""The launch's GRAFT config (the CLI's ``--speculative-graft-*`` flags or ``sgl.Engine``'s
``speculative_graft_*`` keywords) in every process of a server.

The launcher parses it before SGLang resolves the server args; the record carries it within the
process (``seams.GRAFT_CONFIG_ATTR``), and :data:`CONFIG_ENV` to the processes SGLang starts: a
``ServerArgs`` record pickled to a spawned scheduler (CUDA, tensor-parallel ranks) loses the
attributes set on it (msgspec pickles its fields only), which would leave a GPU server on the
defaults whatever the user asked for."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from sglang_graft import config as graft_config
from sglang_graft.sglang import seams

CONFIG_ENV = "SGLANG_GRAFT_CONFIG"  # set by the launcher for its children; not a user setting

_launch_config: Optional[graft_config.GraftConfig] = None


def set_config(cfg: graft_config.GraftConfig) -> None:
    """The launch's config: for this process's checks and, through :data:`CONFIG_ENV`, for every
    process it starts from now on."""
    global _launch_config
    _launch_config = cfg
    os.environ[CONFIG_ENV] = json.dumps(dataclasses.asdict(cfg))


def config_of(server_args=None) -> graft_config.GraftConfig:
    """The GRAFT config a server runs: the one on its ``server_args`` record, else the launch's
    (this process's, or its launcher's through :data:`CONFIG_ENV`), else the defaults."""
    cfg = getattr(server_args, seams.GRAFT_CONFIG_ATTR, None) if server_args is not None else None
    if cfg is None:
        cfg = _launch_config
    if cfg is None and os.environ.get(CONFIG_ENV):
        cfg = graft_config.config_from_dict(json.loads(os.environ[CONFIG_ENV]))
    return cfg or graft_config.GraftConfig()

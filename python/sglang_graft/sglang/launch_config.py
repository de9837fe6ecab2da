"""The launch's GRAFT config (the CLI's ``--speculative-graft-*`` flags or ``sgl.Engine``'s
``speculative_graft_*`` keywords) in every process of a server.

The launcher parses it before SGLang resolves the server args; the record carries it within the
process (``seams.GRAFT_CONFIG_ATTR``), and :data:`CONFIG_ENV` to the processes SGLang starts: a
``ServerArgs`` record pickled to a spawned scheduler (CUDA, tensor-parallel ranks) loses the
attributes set on it (msgspec pickles its fields only), which would leave a GPU server on the
defaults whatever the user asked for.

The launch's draft kind (:func:`draft_kind`: an EAGLE-3 head or a DFlash block draft, decided once
from the draft model's config in ``GraftAlgorithm.handle_server_args``) travels beside the config's
fields in the same variable, under :data:`DRAFT_KEY`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from sglang_graft import config as graft_config
from sglang_graft.sglang import seams

CONFIG_ENV = "SGLANG_GRAFT_CONFIG"  # set by the launcher for its children; not a user setting
DRAFT_KEY = "draft_kind"  # the draft kind's key in CONFIG_ENV's JSON (beside the config's fields)
EAGLE3, DFLASH = "eagle3", "dflash"  # draft kinds: an EAGLE-3 head (the tree), a DFlash block draft (a chain)
DRAFT_KINDS = (EAGLE3, DFLASH)

_launch_config: Optional[graft_config.GraftConfig] = None
_draft_kind: Optional[str] = None


def set_config(cfg: graft_config.GraftConfig, draft_kind: Optional[str] = None) -> None:
    """The launch's config (and, from ``handle_server_args``, its draft kind; a new launch that does
    not know it yet leaves :func:`draft_kind` at EAGLE-3 until then): for this process's checks and,
    through :data:`CONFIG_ENV`, for every process it starts from now on."""
    global _launch_config, _draft_kind
    if draft_kind is not None and draft_kind not in DRAFT_KINDS:
        raise ValueError(f"unknown GRAFT draft kind {draft_kind!r} (one of {', '.join(DRAFT_KINDS)})")
    _launch_config, _draft_kind = cfg, draft_kind
    payload = dataclasses.asdict(cfg)
    if draft_kind is not None:
        payload[DRAFT_KEY] = draft_kind
    os.environ[CONFIG_ENV] = json.dumps(payload)


def draft_kind() -> str:
    """The launch's draft kind (:data:`EAGLE3` or :data:`DFLASH`): this process's, else its
    launcher's through :data:`CONFIG_ENV` (read once), else EAGLE-3. SGLang asks the algorithm's
    predicates on hot paths, so this is a global read after the first call."""
    global _draft_kind
    if _draft_kind is None:
        raw = os.environ.get(CONFIG_ENV)
        _draft_kind = (json.loads(raw).get(DRAFT_KEY) if raw else None) or EAGLE3
    return _draft_kind


def config_of(server_args=None) -> graft_config.GraftConfig:
    """The GRAFT config a server runs: the one on its ``server_args`` record, else the launch's
    (this process's, or its launcher's through :data:`CONFIG_ENV`), else the defaults."""
    cfg = getattr(server_args, seams.GRAFT_CONFIG_ATTR, None) if server_args is not None else None
    if cfg is None:
        cfg = _launch_config
    if cfg is None and os.environ.get(CONFIG_ENV):
        values = json.loads(os.environ[CONFIG_ENV])
        values.pop(DRAFT_KEY, None)
        cfg = graft_config.config_from_dict(values)
    return cfg or graft_config.GraftConfig()

"""GRAFT's options through SGLang's Python API, and the launch's config in every process.

* ``sgl.Engine(..., speculative_graft_source="sam")``: the keywords parsed as the CLI parses the
  flags of the same names, errors naming the keyword (``sglang_graft.config.config_from_kwargs``),
  and an Engine served greedy token-exact against no speculation with the config its scheduler runs.
* A spawned process (CUDA's schedulers, tensor-parallel ranks) gets the server args pickled, and a
  msgspec record pickles its fields only: the config rides in ``SGLANG_GRAFT_CONFIG`` instead."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from sglang_graft.config import GraftConfig, config_from_kwargs

HERE = Path(__file__).resolve().parent


def test_engine_keywords_parse_as_the_flags_of_the_same_names():
    cfg = config_from_kwargs({"speculative_graft_source": "sam", "speculative_graft_budgets": [1, 4, 16],
                              "speculative_graft_thresholds": 0.3, "speculative_graft_per_step_metrics": True,
                              "speculative_graft_tp_check": None})
    assert (cfg.source, cfg.budgets, cfg.thresholds, cfg.per_step_metrics) == ("sam", (1, 4, 16), (0.3,), True)
    assert cfg.tp_check is None and config_from_kwargs({}) == GraftConfig()
    with pytest.raises(TypeError, match="'speculative_graft_sourc'.*speculative_graft_source"):
        config_from_kwargs({"speculative_graft_sourc": "sam"})
    with pytest.raises(ValueError, match="speculative_graft_source='bogus'.*invalid choice"):
        config_from_kwargs({"speculative_graft_source": "bogus"})
    with pytest.raises(ValueError, match="speculative_graft_budgets=\\['x'\\].*invalid int"):
        config_from_kwargs({"speculative_graft_budgets": ["x"]})
    with pytest.raises(ValueError, match="speculative_graft_per_step_metrics='yes': expected True or False"):
        config_from_kwargs({"speculative_graft_per_step_metrics": "yes"})


_SPAWNED = """
import multiprocessing as mp, sys
from sglang_graft.config import GraftConfig
from sglang_graft.sglang import launch_config

def child(q):
    q.put(launch_config.config_of(None).source)

if __name__ == "__main__":
    launch_config.set_config(GraftConfig(source=sys.argv[1]))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start(); print(q.get(timeout=120)); p.join()
"""


class Record(msgspec.Struct, dict=True):  # how ServerArgs is declared (SGLang 0.5.23)
    model_path: str = ""


def test_a_spawned_process_runs_the_launch_config(tmp_path):
    record = Record()
    record._graft_config = GraftConfig(source="sam")
    assert not hasattr(pickle.loads(pickle.dumps(record)), "_graft_config")  # why the environment carries it
    script = tmp_path / "spawned.py"
    script.write_text(_SPAWNED)
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_GRAFT_CONFIG"}
    out = subprocess.run([sys.executable, str(script), "recycle"], capture_output=True, text=True, timeout=300,
                         env=env, check=True)
    assert out.stdout.split()[-1] == "recycle", out.stderr[-2000:]  # not the default, auto


@pytest.mark.server
def test_sgl_engine_takes_grafts_keywords_and_stays_token_exact(tiny_models, plain_llama, tmp_path):
    from transformers import AutoTokenizer

    from test_graft_server import OTHER, REPETITIVE

    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in (REPETITIVE[0], REPETITIVE[1], OTHER[0])]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("SGLANG_GRAFT_CONFIG", None)
    proc = subprocess.Popen([sys.executable, str(HERE / "engine_script.py"), str(tiny_models["llama"]),
                             str(tiny_models["llama-eagle3"]), str(tmp_path / "ids.json"), str(tmp_path / "out.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    # the scheduler's worker runs the keywords, not the defaults
    assert (out["config"]["source"], out["config"]["budget_mode"], out["config"]["retrieval_max_depth"]) == (
        "sam", "fixed", 5)
    want = [plain_llama.generate_ids(p, 24)["output_ids"] for p in ids]
    assert out["outputs"] == want
    assert out["retrieved"] > 0  # the repetitive prompts' continuations came from the suffix automaton

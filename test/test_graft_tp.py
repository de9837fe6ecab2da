"""GRAFT under tensor parallelism: two CPU ranks (gloo), greedy output token-exact against the same
TP 2 server without speculation, with ``--speculative-graft-tp-check 1`` comparing a hash of every
verify tree across the ranks (a real all-reduce) and the cost model's published step costs summed
over them; with and without the sync-free step, and sync-free with each request's own calibration
(``--speculative-graft-request-calibration on``: per-request tables on every rank)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests

from pinned_costs import pinned_env
from server_utils import SGLangServer
from test_graft_server import NEW_TOKENS, _ids

pytestmark = pytest.mark.server

# one CPU core per rank (SGLang's CPU path binds each rank's OpenMP threads to its own cores)
TP2 = ["--tp", "2"]
TP2_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


def _concurrently(srv, ids):
    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: srv.generate_ids(p, NEW_TOKENS)["output_ids"], ids))


@pytest.fixture(scope="module")
def tp2_reference(tiny_models, server_logs):
    ids = _ids(tiny_models["llama"])[:12]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in TP2_ENV.items():
            mp.setenv(k, v)
        with SGLangServer(tiny_models["llama"], TP2, log_path=server_logs / "tp2-ref.log") as srv:
            return ids, _concurrently(srv, ids)


@pytest.mark.parametrize("sync_free,extra", [("off", []), ("on", []),
                                             ("on", ["--speculative-graft-request-calibration", "on"])],
                         ids=["sync-free-off", "sync-free-on", "sync-free-request-calibration"])
def test_graft_tp2_token_exact_with_the_tree_check(tiny_models, server_logs, monkeypatch, tp2_reference, sync_free,
                                                  extra, tmp_path):
    """``sync_free on``: both ranks take in the same lagged results at the same calls and re-root
    along the same device paths, so their trees stay equal too. Step costs pinned (retrieval must
    be accepted whatever the machine's load)."""
    for k, v in TP2_ENV.items():
        monkeypatch.setenv(k, v)
    ids, ref = tp2_reference
    graft = ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
             "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8",
             "--speculative-graft-tp-check", "1", "--speculative-graft-sync-free", sync_free, "--enable-metrics", *TP2, *extra]
    with SGLangServer(tiny_models["llama"], graft, log_path=server_logs / f"tp2-graft-{sync_free}{len(extra)}.log",
                      env=pinned_env(tmp_path / "pinned")) as srv:
        outs = _concurrently(srv, ids)
        info = requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]["graft"]
        metrics = requests.get(srv.url + "/metrics", timeout=30).text
        log = srv.tail(10 ** 8)
    assert outs == ref
    # GRAFT's counters once per server, on SGLang's logging rank and with its labels (not once per rank)
    series = [line for line in metrics.splitlines() if line.startswith("sglang:graft_verify_steps_total{")]
    assert len(series) == 1 and 'tp_rank="0"' in series[0] and "model_name=" in series[0], series
    assert int(float(series[0].split()[-1])) == info["verify_steps"]
    assert info["sync_free"] is (sync_free == "on")
    assert ("request_calibration" in info["economy"]) is bool(extra)
    steps = info["economy"]["steps"] - info["economy"]["plain_steps"]  # plain steps have no tree
    assert steps > 0 and info["tp_checks"] == steps  # every tree compared across both ranks
    assert info["accepted_retrieved_tokens"] > 0  # the repetitive prompts are served from retrieval
    assert "Traceback" not in log

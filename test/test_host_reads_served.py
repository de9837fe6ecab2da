"""SGLang's own host reads per GRAFT decode step are bounded by those SGLang's EAGLE-3 makes per
decode step on the same load, so that a sync GRAFT causes inside SGLang's code (a value SGLang
reads on the host only because of what GRAFT hands it) cannot pass unnoticed.

Both servers count with ``SGLANG_GRAFT_COUNT_HOST_READS=1`` and report ``host_reads`` in
``/server_info`` (:mod:`sglang_graft.sglang.host_reads`: the calls of SGLang's
``EAGLEWorkerV2.forward_batch_generation``, which GRAFT's worker reaches through ``super()``)."""

from __future__ import annotations

import concurrent.futures as cf
import time
from fractions import Fraction

import pytest
import requests

from server_utils import SGLangServer
from test_graft_server import OTHER, REPETITIVE

pytestmark = pytest.mark.server

NEW_TOKENS = 64
PROMPTS = REPETITIVE[:3] + OTHER[:5]  # one at a time: the first three and the last; then all eight at once
FINISH_GAP = 4  # the i-th request of the eight asks NEW_TOKENS - FINISH_GAP * i: they leave the batch at
# different steps, so the batch changes however the scheduler happens to admit them
COUNT_READS = {"SGLANG_GRAFT_COUNT_HOST_READS": "1"}
DRAFT_SHAPE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"]
PARTS = ("steady", "changed")  # decode steps on the previous call's requests / after requests joined or left
KINDS = {"sglang": "sglang_sites", "cpu_kernels": "cpu_kernel_sites"}  # bounded kinds of reads, their sites


def _ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _serve_load(tiny_models, server_logs, algorithm: str, name: str, *extra) -> tuple[list, dict, float]:
    """The load, greedy: four requests one at a time (``NEW_TOKENS`` each), then all eight at once
    (``NEW_TOKENS - FINISH_GAP * i``: a request leaving changes the batch). Returns the outputs, the scheduler's ``/server_info`` state and the seconds it all took."""
    t0 = time.monotonic()
    ids = _ids(tiny_models["llama"])
    args = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path",
            str(tiny_models["llama-eagle3"]), *DRAFT_SHAPE, *extra]
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / f"host-reads-{name}.log",
                      env=COUNT_READS) as srv:
        singles = [srv.generate_ids(ids[i], NEW_TOKENS)["output_ids"] for i in (0, 1, 2, len(ids) - 1)]
        with cf.ThreadPoolExecutor(len(ids)) as pool:
            futures = [pool.submit(srv.generate_ids, p, NEW_TOKENS - FINISH_GAP * i) for i, p in enumerate(ids)]
            batch = [f.result()["output_ids"] for f in futures]
        state = requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]
    return singles + batch, state, time.monotonic() - t0


def _per_step(reads: dict, part: str, kind: str) -> Fraction:
    return Fraction(reads[part][kind], reads[f"{part}_steps"])


def _summary(reads: dict) -> str:
    return ", ".join(f"{part} ({reads[f'{part}_steps']} steps): " + " ".join(
        f"{kind} {float(_per_step(reads, part, kind)):.3f}" if reads[f"{part}_steps"] else f"{kind} -"
        for kind in (*KINDS, "graft")) for part in PARTS)


@pytest.fixture(scope="module")
def eagle3(tiny_models, server_logs):
    outs, state, seconds = _serve_load(tiny_models, server_logs, "EAGLE3", "eagle3")
    reads = state["host_reads"]
    print(f"\nEAGLE-3 ({seconds:.0f} s): reads per decode step, {_summary(reads)}\n{reads}")
    assert reads["steady_steps"] > 100 and reads["changed_steps"] > 0, reads
    assert reads["graft"] == 0, reads["graft_sites"]  # GRAFT's hooks on SGLang functions read nothing
    assert reads["steady"]["sglang"] > 0 and reads["steady"]["cpu_kernels"] > 0, reads  # the counter was on
    return outs, reads


@pytest.mark.parametrize("mode,extra", [("default", [])])  # sync-free: 0 of GRAFT's reads, test_graft_server.py
def test_sglang_reads_per_graft_step_at_most_eagle3s(tiny_models, server_logs, eagle3, mode, extra):
    """For each part of the decode steps, steady and changed, and each kind of read, SGLang's and
    the CPU stand-ins', GRAFT's reads per step <= EAGLE-3's:

    ``host_reads[part][kind] / host_reads[part + "_steps"]``, where

    * the reads are those inside the calls of SGLang's ``forward_batch_generation`` on a decode
      batch (prefills apart: GRAFT takes fewer decode steps for the same tokens, so a prefill's
      reads would weigh more per GRAFT step);
    * ``changed`` are the decode steps on other requests than the worker's previous call (requests
      joined or left the running batch: SGLang then recomputes the batch's length total,
      ``ForwardBatch.init_new``), ``steady`` the others: how many steps follow a batch change
      depends on when requests arrive and finish, so the reads per change and the reads per
      steady step are bounded apart;
    * ``sglang``: SGLang's own modules (every module outside ``sglang_graft``), the bound the
      issue asks for. ``cpu_kernels``: sglang-graft's torch stand-ins for SGLang's CUDA kernels,
      bounded apart, not added in: on a GPU they are kernels that read nothing on the host, so
      their CPU reads are an artifact of the test bed, and a sum would let fewer reads of one kind
      hide more of the other; SGLang calls them with GRAFT's trees, so they are bounded too.

    GRAFT's own reads (``graft``; none when sync-free) are not SGLang's and are tested elsewhere.
    """
    eagle_outs, eagle = eagle3
    outs, state, seconds = _serve_load(tiny_models, server_logs, "GRAFT", f"graft-{mode}", *extra)
    graft, reads = state["graft"], state["host_reads"]
    print(f"\nGRAFT {mode} ({seconds:.0f} s): reads per decode step, {_summary(reads)}\n{reads}")
    assert outs == eagle_outs  # the same load (both lossless)
    # every GRAFT decode step went through SGLang's method, and every SGLang read happened inside it
    assert reads["decode_steps"] == graft["economy"]["steps"] and reads["sglang"] == graft["host_reads"]["sglang"]
    assert reads["steady_steps"] > 100 and reads["changed_steps"] > 0, reads
    for part in PARTS:
        for kind, sites in KINDS.items():
            assert _per_step(reads, part, kind) <= _per_step(eagle, part, kind), (
                f"{kind} reads per {part} decode step: GRAFT {float(_per_step(reads, part, kind)):.3f} > EAGLE-3 "
                f"{float(_per_step(eagle, part, kind)):.3f} ({reads[f'{part}_steps']} and {eagle[f'{part}_steps']} "
                f"steps); sites: GRAFT {reads[part][sites]}, EAGLE-3 {eagle[part][sites]}")

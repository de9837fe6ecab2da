"""``benchmark/studies/step_profile.py`` sorts py-spy samples into the parts of a decode step."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark" / "studies"))

import step_profile  # noqa: E402

LOOP = "event_loop_normal (scheduler.py:1);run_batch (scheduler.py:2)"
GRAFT_FWD = "forward_batch_generation (worker.py:3);verify (worker.py:4);run_eagle_verify (eagle_worker_common.py:5);" \
    "forward (model_runner.py:6)"
RAW = "\n".join([
    f"{LOOP};_forward_prefill_batch (worker.py:7);forward (model_runner.py:6) 7",
    f"{LOOP};{GRAFT_FWD};rows_linear_kernel (linear.py:8);_product (/x/linear.py:9) 5",
    f"{LOOP};{GRAFT_FWD};forward (radix_attention.py:10);extend_attention_cpu (attention.py:11) 3",
    f"{LOOP};{GRAFT_FWD};forward (layernorm.py:12) 2",
    f"{LOOP};forward_batch_generation (worker.py:3);draft (draft_worker.py:13);forward (model_runner.py:6) 4",
    f"{LOOP};forward_batch_generation (worker.py:3);build (step.py:14) 6",
    "recv_requests (scheduler.py:15) 1",
])


def test_samples_are_sorted_into_the_parts_of_a_step(tmp_path):
    # py-spy's raw stacks name ModelRunner.forward as "forward (model_runner.py:N)": the frames are
    # matched by file and function, so the names below are those the classifier reads
    raw = tmp_path / "graft.raw"
    raw.write_text(RAW.replace("forward (model_runner.py:6)", "ModelRunner.forward (model_runner.py:6)")
                   .replace("forward (radix_attention.py:10)", "RadixAttention.forward (radix_attention.py:10)"))
    counts = step_profile.parts(raw, "GRAFT")
    assert counts == {"prefill": 7, "linear": 5, "attention": 3, "forward rest": 2, "draft forward": 4,
                      "step logic": 6, "idle and other processes": 1}


def test_a_plain_servers_extend_is_its_prefill():
    frames = ["scheduler.py:run_batch", "model_runner.py:ModelRunner.forward", "eager_runner.py:EagerRunner._execute_extend"]
    assert step_profile.classify(frames, "none") == "prefill"
    assert step_profile.classify(frames, "GRAFT") == "draft forward"  # no verify above it
    decode = ["scheduler.py:run_batch", "model_runner.py:ModelRunner.forward", "linear.py:_product"]
    assert step_profile.classify(decode, "none") == "linear"


def test_a_block_drafts_samples_are_sorted_by_where_its_step_is(tmp_path):
    """A DFlash worker's step is one function: its frame's line says prefill or decode, the frames
    under it which part of the decode step."""
    end = step_profile._prefill_end_line()
    step = f"GraftDFlashWorker.forward_batch_generation (block_worker.py:200);" \
           f"DFlashWorkerV2.forward_batch_generation (/x/dflash_worker_v2.py:{{line}})"
    target = "TpModelWorker.forward_batch_generation (tp_worker.py:1);ModelRunner.forward (model_runner.py:6)"
    raw = "\n".join([
        f"{LOOP};{step.format(line=end - 40)};{target} 7",  # the prompt's forward
        f"{LOOP};{step.format(line=end - 30)};_append_target_hidden_to_draft_kv_by_loc (dflash_worker_v2.py:9) 1",
        f"{LOOP};{step.format(line=end + 400)};{target};_product (/x/linear.py:9) 5",
        f"{LOOP};{step.format(line=end + 400)};{target};RadixAttention.forward (radix_attention.py:10) 3",
        f"{LOOP};{step.format(line=end + 400)};{target};forward (layernorm.py:12) 2",
        f"{LOOP};{step.format(line=end + 200)};ModelRunner.forward (model_runner.py:6) 4",  # the draft model
        f"{LOOP};{step.format(line=end + 300)};GraftDFlashWorker._greedy_sample_from_vocab_parallel_head "
        "(block_worker.py:240);greedy_with_confidence (block_pick.py:30) 6",  # the pick
        f"{LOOP};{step.format(line=end + 300)};GraftDFlashWorker._greedy_sample_from_vocab_parallel_head "
        "(block_worker.py:240);GraftDFlashWorker._graft (block_worker.py:270) 8",  # retrieval and pruning
        f"{LOOP};{step.format(line=end + 500)};_append_target_hidden_to_draft_kv_by_loc (dflash_worker_v2.py:9) 9",
        "recv_requests (scheduler.py:15) 1",
    ])
    path = tmp_path / "block.raw"
    path.write_text(raw)
    sglang_pick = ["scheduler.py:run_batch:2", f"dflash_worker_v2.py:DFlashWorkerV2.forward_batch_generation:{end + 300}",
                   "dflash_worker_v2.py:DFlashWorkerV2._greedy_sample_from_vocab_parallel_head:700"]
    assert step_profile.classify_block(sglang_pick, end, "DFLASH") == "draft forward"
    assert step_profile.classify_block(sglang_pick, end, "GRAFT-DFlash") == "step logic"
    assert step_profile.parts(path, "GRAFT-DFlash-plain") == {
        "prefill": 8, "linear": 5, "attention": 3, "forward rest": 2, "draft forward": 10, "draft KV append": 9,
        "step logic": 8, "idle and other processes": 1}

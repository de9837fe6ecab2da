"""SGLang's launcher with a stand-in for the draft-extend CUDA graph (a test mode; CPU servers).

    python test/draft_extend_graph_standin.py RECORD_FILE <sglang.launch_server arguments>

Every EAGLE draft worker gets, in place of the draft-extend graph runner a CPU has none of, a
runner that takes the graph's path eagerly: SGLang's draft extend calls its ``execute(forward_batch,
select_index)`` (``can_run_graph`` always holds) and it runs the draft model the way the captured
graph does, with the batch's positions as prepared and without ``ModelRunner.forward`` (whose hooks
a replay skips): attention metadata, the model's forward, the selected rows. Each call appends the
largest position it ran at to ``RECORD_FILE``. The scheduler is forked on a CPU (the CPU port), so
the patch made here reaches it.
"""

from __future__ import annotations

import runpy
import sys


class DraftExtendGraphStandin:
    """What ``EAGLEDraftExtendCudaGraphRunner`` does for SGLang's draft extend, eagerly."""

    def __init__(self, draft_runner, record: str):
        self.model_runner, self.record = draft_runner, record

    def can_run_graph(self, forward_batch) -> bool:
        return True

    def execute(self, forward_batch, select_index):
        with open(self.record, "a") as f:
            f.write(f"{int(forward_batch.positions.max())}\n")
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        runner = self.model_runner
        runner.attn_backend.init_forward_metadata(forward_batch)
        with forward_context(ForwardContext(attn_backend=runner.attn_backend), forward_batch=forward_batch):
            out = runner.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)
        out.next_token_logits = out.next_token_logits[select_index]
        if out.hidden_states is not None:
            out.hidden_states = out.hidden_states[select_index]
        return out


def install(record: str) -> None:
    from sglang.srt.speculative import eagle_worker_v2

    worker = eagle_worker_v2.EagleDraftWorker
    capture = worker._capture_cuda_graphs

    def with_standin(self):
        capture(self)
        self.cuda_graph_runner_for_draft_extend = DraftExtendGraphStandin(self.draft_runner, record)

    worker._capture_cuda_graphs = with_standin


if __name__ == "__main__":
    install(sys.argv[1])
    sys.argv = ["sglang.launch_server", *sys.argv[2:]]
    runpy.run_module("sglang.launch_server", run_name="__main__")

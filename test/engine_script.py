"""Runs ``sgl.Engine`` with GRAFT's options as keyword arguments (a child of ``test_engine_api.py``).

    python test/engine_script.py MODEL DRAFT IDS_JSON OUT_JSON

Greedy, 24 new tokens per prompt of ``IDS_JSON`` (lists of token ids); writes the output ids and
the GRAFT config the scheduler's worker runs (``/server_info`` ``graft.config``) to ``OUT_JSON``."""

import json
import sys


def main() -> None:
    import sglang as sgl

    model, draft, ids_path, out_path = sys.argv[1:5]
    llm = sgl.Engine(model_path=model, device="cpu", dtype="float32", max_total_tokens=8192,
                     skip_server_warmup=True, sleep_on_idle=True,
                     speculative_algorithm="GRAFT", speculative_draft_model_path=draft,
                     speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=8,
                     speculative_graft_source="sam", speculative_graft_budget_mode="fixed",
                     speculative_graft_retrieval_max_depth=5)
    try:
        ids = json.load(open(ids_path))
        outs = [llm.generate(input_ids=p, sampling_params={"max_new_tokens": 24, "temperature": 0})["output_ids"]
                for p in ids]
        graft = llm.get_server_info()["internal_states"][0]["graft"]
    finally:
        llm.shutdown()
    json.dump({"outputs": outs, "config": graft["config"],
               "retrieved": graft["accepted_retrieved_tokens"]}, open(out_path, "w"))


if __name__ == "__main__":
    main()

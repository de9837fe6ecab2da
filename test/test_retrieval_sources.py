"""The retrieval-source interface: a source registered from outside the package (here, from this
file only) is a ``--speculative-graft-source`` choice, gets its own calibration bins, combines with
the built-in sources, and serves token-exact on a real server (the registration reaches the server
processes through a ``sitecustomize`` on their ``PYTHONPATH``)."""

from __future__ import annotations

import argparse
import os
import textwrap

import pytest
import requests
import torch

# A toy third source: the anchor token repeated, one chain of DEPTH nodes; one calibration bin per
# depth. Run in this process by the fixture below, and in every server process by the shim.
REPEAT_SOURCE = textwrap.dedent('''
    import torch

    from sglang_graft.retrieval import RetrievalSource, SourceProposal, register_source


    class RepeatLastToken(RetrievalSource):
        """Proposes the anchor token ``DEPTH`` times in a chain (a token that repeats, repeats)."""

        name = "repeat"
        DEPTH = 4
        num_bins = DEPTH  # one per depth

        def __init__(self, device):
            self.device = device

        def width(self):
            return self.DEPTH

        def propose(self, rids, anchor_tokens, width, scopes=None, pending=None):
            bs = anchor_tokens.shape[0]
            device = anchor_tokens.device
            depth = torch.arange(1, self.DEPTH + 1, device=device)[None, :]
            tokens = anchor_tokens.to(torch.int64)[:, None].expand(bs, self.DEPTH).contiguous()
            parents = (depth - 2).expand(bs, -1).contiguous()  # -1, 0, 1, ...: a chain
            scores = (-depth.float()).expand(bs, -1).contiguous()
            valid = torch.ones((bs, self.DEPTH), dtype=torch.bool, device=device)
            return SourceProposal(tokens, parents, scores, valid, depth=depth)

        def bin_prior(self):
            return torch.pow(0.5, torch.arange(1, self.DEPTH + 1, dtype=torch.float32))

        def bins(self, proposal):
            return (proposal.depth - 1).expand_as(proposal.tokens)


    def register():
        register_source(RepeatLastToken.name, lambda cfg, context: RepeatLastToken(context.device))
''')


@pytest.fixture
def repeat_source():
    """``repeat`` registered for the test, unregistered after it (other tests see the built-ins)."""
    from sglang_graft.retrieval import unregister_source

    namespace: dict = {}
    exec(compile(REPEAT_SOURCE, "repeat_source", "exec"), namespace)
    namespace["register"]()
    yield namespace["RepeatLastToken"]
    unregister_source("repeat")


def test_the_built_in_source_choices():
    from sglang_graft.config import SOURCES
    from sglang_graft.retrieval import selected_sources

    assert tuple(SOURCES) == ("sam", "recycle", "auto", "none")
    assert selected_sources("auto") == ("sam", "recycle") and selected_sources("none") == ()


def test_a_registered_source_is_a_flag_choice(repeat_source):
    from sglang_graft.config import GraftConfig, SOURCES, add_cli_args, config_from_namespace, validate
    from sglang_graft.retrieval import selected_sources, unregister_source

    assert tuple(SOURCES) == ("sam", "recycle", "repeat", "auto", "none")
    assert selected_sources("auto") == ("sam", "recycle")  # auto: the sources registered for it
    parser = argparse.ArgumentParser()
    add_cli_args(parser)  # the choices are a live view: a later registration is seen too
    cfg = config_from_namespace(parser.parse_args(["--speculative-graft-source", "repeat"]))
    assert cfg == GraftConfig(source="repeat")
    validate(cfg, num_nodes=8, num_steps=3, topk=2)
    unregister_source("repeat")
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-graft-source", "repeat"])
    with pytest.raises(ValueError, match="--speculative-graft-source must be one of sam, recycle, auto, none"):
        validate(cfg, num_nodes=8, num_steps=3, topk=2)


def _retrieval(source: str, num_nodes: int = 8):
    from sglang_graft.config import GraftConfig
    from sglang_graft.engine.retrieval_state import GraftRetrieval

    return GraftRetrieval(GraftConfig(source=source), 64, num_nodes=num_nodes, num_stages=3, device="cpu",
                          max_requests=4)


def test_the_engine_drives_a_registered_source(repeat_source):
    from sglang_graft.engine.budget import AcceptanceCalibration

    r = _retrieval("repeat")
    cal = AcceptanceCalibration(sources=r.sources)
    assert cal.ranges == {"draft": (0, 16), "repeat": (16, 20)} and list(cal.as_dict()) == ["draft", "repeat"]
    r.admit("a", [1, 2, 3])
    r.admit("b", [4])
    assert r.rows_needing_root(["a", "b"]) == []  # the source follows no context
    props, bins = r.propose_scored(["a", "b"], torch.tensor([7, 9]), r.scope_index(["a", "b"]), cal)
    width = r.proposal_width()
    assert width == 7 and props.tokens.shape == bins.shape == (2, width)  # padded to N - 1
    assert props.tokens[:, :4].tolist() == [[7] * 4, [9] * 4] and not props.valid[:, 4:].any()
    assert props.parents[0, :4].tolist() == [-1, 0, 1, 2]
    assert bins[:, :4].tolist() == [[16, 17, 18, 19]] * 2  # its own range, by depth
    assert cal.probability(bins[0, :4]).tolist() == pytest.approx([0.5, 0.25, 0.125, 0.0625])
    assert r.proposal_width(union=True) == 4
    r.release("a")


def test_union_and_auto_combine_any_sources(repeat_source):
    from sglang_graft.retrieval import SourceCombiner

    sam = _retrieval("sam").sources[0]
    sam.admit("a", [1, 2, 3, 4, 1, 2, 3], None, None)  # suffix "1 2 3" matched: sam proposes 4 ...
    sam.admit("b", [5, 6], None, None)  # no match
    both = SourceCombiner([sam, repeat_source("cpu")], num_nodes=8)
    assert both.width(union=True) == 7 + 4 and both.width() == 7
    props, bins = both.propose(["a", "b"], torch.tensor([3, 6]), bin_offsets=[16, 336], union=True)
    assert props.tokens.shape == (2, 11)
    assert props.tokens[:, 7:].tolist() == [[3] * 4, [6] * 4] and props.parents[0, 7:].tolist() == [-1, 7, 8, 9]
    assert bins[:, 7:].tolist() == [[336, 337, 338, 339]] * 2 and bins[:, :7].lt(336).all()
    sam.auto_match_threshold = 3
    props, bins = both.propose(["a", "b"], torch.tensor([3, 6]), bin_offsets=[16, 336])
    assert props.tokens[0, 0].item() == 4 and bins[0, 0].item() < 336  # a: sam (match 3)
    assert props.tokens[1, :4].tolist() == [6] * 4 and bins[1, 0].item() == 336  # b: the next source


@pytest.mark.server
def test_a_source_registered_by_a_test_serves_token_exact(tiny_models, server_logs, plain_llama, tmp_path):
    """A GRAFT server whose only retrieval is the toy source (every checkpoint prunes to the root):
    greedy output token-exact against no speculation, and the toy's proposals verified and accepted."""
    from transformers import AutoTokenizer

    from pinned_costs import pinned_source
    from server_utils import SGLangServer

    prompts = ["ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab", "x = 1\nx = 1\nx = 1\nx = 1\n",
               "The quick brown fox", "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"]
    tok = AutoTokenizer.from_pretrained(tiny_models["llama"])
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    new_tokens = 32
    reference = [plain_llama.generate_ids(p, new_tokens)["output_ids"] for p in ids]
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(REPEAT_SOURCE + "\n\nregister()\n" + pinned_source())  # costs pinned
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)}
    args = ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8",
            "--speculative-graft-source", "repeat", "--speculative-graft-thresholds", "1", "1", "1",
            "--speculative-graft-keep-fractions", "0", "0", "0", "--speculative-graft-checkpoint-depths", "0", "1", "2"]
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "graft-repeat-source.log", env=env) as srv:
        outs = [srv.generate_ids(p, new_tokens) for p in ids]
        graft = requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]["graft"]
    assert [o["output_ids"] for o in outs] == reference
    shown = graft["economy"]["calibration"]["repeat"]["shown"]
    assert sum(shown) > 0, graft["economy"]["calibration"]  # its nodes were verified, in its own bins
    assert graft["accepted_draft_tokens"] == 0 < graft["accepted_retrieved_tokens"], graft

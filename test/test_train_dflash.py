"""``benchmark/train_dflash.py``: the batched block training forward is the reference model's own
inference forward, block by block, and the config it writes is what SGLang's DFLASH parses."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark"))
import train_dflash  # noqa: E402

TARGET = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "vocab_size": 64, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
          "rope_parameters": {"rope_theta": 10000.0}, "num_hidden_layers": 6, "bos_token_id": 1,
          "eos_token_id": 2}
LAYER_IDS = [1, 2, 3]


def _data(seqs: int = 3, t: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(20, 64, (seqs, t), generator=g)
    lens = torch.tensor([t, t - 7, 19])[:seqs]
    labels = torch.randint(0, 64, (seqs, t), generator=g)
    aux = torch.randn(seqs, t, len(LAYER_IDS) * TARGET["hidden_size"], generator=g)
    embed = torch.randn(64, TARGET["hidden_size"], generator=g)
    lm = torch.randn(64, TARGET["hidden_size"], generator=g)
    return tokens, lens, labels, aux, embed, lm


def test_batched_blocks_equal_the_reference_forward_of_each_block():
    """Every block of the one-forward training batch gives the logits the reference model gives that
    block alone (context: the features before its anchor; block: anchor token then masks), and the
    targets are the target's greedy tokens at anchor + 1 .. anchor + B - 1."""
    torch.manual_seed(0)
    block, k = 4, 3
    dcfg = train_dflash.draft_config(TARGET, 2, block, LAYER_IDS, mask_token_id=5)
    model = train_dflash.build_model(dcfg).eval()
    tokens, lens, labels, aux, embed, lm = _data()
    noise, ctx, pos, mask, target, valid = train_dflash.block_batch(
        tokens, lens, labels, aux, embed, block, k, torch.Generator().manual_seed(3), mask_token_id=5)
    with torch.no_grad():
        batched = train_dflash.block_logits(model, lm, noise, ctx, pos, mask, block, k)
    t = tokens.shape[1]
    checked = 0
    for s in range(tokens.shape[0]):
        for j in range(k):
            if not valid[s, j]:
                continue
            a = int(pos[s, t + j * block])
            assert 1 <= a and a + block - 1 <= int(lens[s]) - 1  # every label position lies in the sequence
            ids = torch.full((1, block), 5)
            ids[0, 0] = tokens[s, a]
            with torch.no_grad():
                hidden = model(position_ids=torch.arange(a + block)[None], noise_embedding=embed[ids],
                               target_hidden=aux[s:s + 1, :a])[:, 1:]
            torch.testing.assert_close(batched[s, j], (hidden @ lm.T)[0], rtol=1e-4, atol=1e-4)
            assert target[s, j].tolist() == labels[s, a:a + block - 1].tolist()
            checked += 1
    assert checked == int(valid.sum()) >= 7  # the short sequence still gets its blocks


def test_a_sequence_too_short_for_a_block_gets_none():
    tokens, lens, labels, aux, embed, _ = _data()
    lens = torch.tensor([40, 4, 5])  # a block of 4 needs a + 3 <= len - 1 with a >= 1: len >= 5
    *_, valid = train_dflash.block_batch(tokens, lens, labels, aux, embed, 4, 2, torch.Generator().manual_seed(0),
                                         mask_token_id=5)
    assert valid.tolist() == [[True, True], [False, False], [True, False]]


def test_the_written_config_is_what_sglangs_dflash_parses():
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    dcfg = train_dflash.draft_config(TARGET, 2, 8, LAYER_IDS, mask_token_id=5)
    parsed = parse_dflash_draft_config(draft_hf_config=dcfg)
    assert parsed.resolve_block_size() == 8
    assert parsed.resolve_target_layer_ids(target_num_layers=6) == LAYER_IDS
    assert parsed.mask_token_id == 5
    assert dcfg["architectures"] == ["DFlashDraftModel"]  # what selects GRAFT's block mode

"""The engine's revocable decoders inside Nemotron-Labs-Diffusion's blocks, with the family's
causal commit: a finished block's K/V are rewritten by a causal forward (rows before the current
block see only earlier keys; attention/layout.py `_row_limit`), the current block is
bidirectional. The per-block cache equals recomputation (kv_cache="none" runs every step from
position 0 under the same visibility), alone and batched; the dense mask below is the oracle of
one step's visibility."""

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.attention.base import SeqLayout
from golden_cases import GOLDEN

DIR = str(GOLDEN / "nemotron" / "model_long")
DECODERS = ("cover", "threshold", "low_confidence", "wino", "saber")


def _prompts():
    gen = torch.Generator().manual_seed(11)
    return [{"prompt_token_ids": [1] + torch.randint(12, 160, (int(n),), generator=gen).tolist()}
            for n in (5, 9, 14)]


@pytest.mark.parametrize("decoding", DECODERS)
def test_cache_equals_recomputation(decoding):
    sps = SamplingParams(max_tokens=16, block_length=8, decoding=decoding)
    outs = {}
    for kv in ("none", "dual"):
        llm = LLM(DIR, dtype="float32", kv_cache=kv, kv_cache_memory_bytes=8 << 20)
        outs[kv] = llm.generate(_prompts(), sps, use_tqdm=False)
        alone = llm.generate(_prompts()[1], sps, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == outs[kv][1].outputs[0].token_ids
    for a, b in zip(outs["none"], outs["dual"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert 0 < len(a.outputs[0].token_ids) <= 16


def test_commit_rows_are_causal():
    """A window [0, 20) with blocks of 8: rows 0..15 (finished blocks) see keys <= their
    position, rows 16..19 (the current block) every key < 24 they may see."""
    seq = SeqLayout(0, 20, torch.arange(24), [], causal_block=8, causal_commit=True)
    limits = seq.key_limits()
    assert limits[:16].tolist() == list(range(1, 17))
    assert limits[16:].tolist() == [24] * 4
    plain = SeqLayout(0, 20, torch.arange(24), [], causal_block=8)
    assert plain.key_limits()[:8].tolist() == [8] * 8


def test_batch_metadata_row_limits_follow_the_causal_commit():
    """build_metadata (what every backend reads): a causal-commit sequence's rows get the
    same bounds as SeqLayout.key_limits beside a plain block-causal one and a full one."""
    from cover_vllm.attention.layout import build_metadata

    commit = SeqLayout(0, 20, torch.arange(24), [], causal_block=8, causal_commit=True)
    block = SeqLayout(8, 12, torch.arange(24, 48), [], causal_block=8)
    full = SeqLayout(0, 5, torch.arange(48, 53), [])
    meta = build_metadata([commit, block, full])
    limits = meta.row_limit.tolist()
    assert limits[:20] == commit.key_limits().tolist()
    assert limits[20:32] == block.key_limits().tolist()
    assert min(limits[32:]) >= 5

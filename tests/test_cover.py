"""COVER in the engine: empty seed set == threshold, batching invariance, accounting."""

import random

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.models.spec import ModelSpec
from cover_vllm.scheduler.request import Request
from cover_vllm.strategies import make_params, strategy_class


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(290) for _ in range(rng.randint(4, 16))]}
            for _ in range(n)]


@pytest.mark.parametrize("mode", ["none", "prefix", "dual"])
def test_empty_seed_set_equals_threshold(llada_dir, mode):
    """(On Dream `threshold` follows Fast-dLLM's Dream quota rule, so only LLaDA compares.)"""
    llm = LLM(llada_dir, kv_cache=mode)
    prompts = _prompts(8, seed=1)
    base = dict(max_tokens=24, block_length=8)
    plain = llm.generate(prompts, SamplingParams(**base, decoding="threshold",
                                                 decoding_params={"threshold": 0.6}),
                         use_tqdm=False)
    cover = llm.generate(prompts, SamplingParams(**base, decoding="cover", decoding_params={
        "draft_threshold": 0.6, "k_min": 0, "k_max": 0}), use_tqdm=False)
    for a, b in zip(plain, cover):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.metrics.nfe == b.metrics.nfe and b.metrics.seeds_verified == 0


@pytest.mark.parametrize("mode", ["none", "prefix", "dual"])
@pytest.mark.parametrize("model", ["llada", "dream"])
def test_cover_verifies_and_batches_like_alone(llada_dir, dream_dir, mode, model):
    """COVER mixed with other strategies in one batch gives the tokens it gives alone."""
    llm = LLM(llada_dir if model == "llada" else dream_dir, kv_cache=mode)
    prompts = _prompts(12, seed=2)
    params = []
    for i in range(12):
        name = ["cover", "threshold", "low_confidence", "cover"][i % 4]
        params.append(SamplingParams(max_tokens=16 + 8 * (i % 3), block_length=8, decoding=name))
    together = llm.generate(prompts, params, use_tqdm=False)
    verified = 0
    for prompt, p, out in zip(prompts, params, together):
        (alone,) = llm.generate([prompt], p, use_tqdm=False)
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.metrics.as_dict() | {"latency_s": 0} == out.metrics.as_dict() | {
            "latency_s": 0}
        if p.decoding == "cover":
            verified += out.metrics.seeds_verified
            m = out.metrics
            assert m.seeds_verified == m.keeps + m.replaces + m.remasks
    assert verified > 0                            # the override path was exercised


def test_flip_flop_accounting_on_a_synthetic_trace():
    spec = ModelSpec(family="llada", vocab_size=10, mask_token_id=9, eos_token_ids=(8,),
                     pad_token_id=8, logit_shift=0, max_model_len=64)
    strategy = strategy_class("threshold")(make_params("threshold", None), spec)
    req = Request("r", None, [1, 2], SamplingParams(max_tokens=4, block_length=4), strategy,
                  torch.Generator(), "none")
    t = torch.tensor
    no = t([False] * 4)
    req.apply(2, t([True, True, True, False]), t([5, 6, 7, 0]), None, None)      # commit 3
    req.apply(2, no, t([0] * 4), t([True, True, False, False]), None)            # remask 2
    req.apply(2, t([True, True, False, True]), t([5, 4, 0, 3]), None, None)      # 5 again: F
    req.apply(2, no, t([0, 0, 1, 0]), None, t([False, False, True, False]))      # replace
    m = req.metrics
    assert (m.remasks, m.flip_flops, m.replaces) == (2, 1, 1)
    assert req.canvas.tolist() == [1, 2, 5, 4, 1, 3]


def test_cover_params_are_validated():
    with pytest.raises(ValueError, match="draft_threshold"):
        make_params("cover", {"draft_threshold": 1.5})
    with pytest.raises(ValueError, match="k_min"):
        make_params("cover", {"k_min": 3, "k_max": 1})
    with pytest.raises(ValueError, match="allowed"):
        make_params("cover", {"seeds": 3})

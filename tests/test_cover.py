"""COVER in the engine: empty seed set == threshold, batching invariance, accounting."""

import random

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.models.spec import ModelSpec
from cover_vllm.scheduler.request import Request
from cover_vllm.strategies import make_params, strategy_class
from cover_vllm.strategies.base import BlockState, StepBatch, decide_now
from cover_vllm.strategies.cover import CoverMemory


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


def _cover(params=None):
    spec = ModelSpec(family="llada", vocab_size=10, mask_token_id=9, eos_token_ids=(8,),
                     pad_token_id=8, logit_shift=0, max_model_len=64)
    return strategy_class("cover")(make_params("cover", params), spec)


def _decide_one(tokens, seeds, probs, params=None, strategy=None, state=None):
    """Cover.decide on one request whose view is one block; probs [n, V] per row. Pass the
    strategy and state to continue a block."""
    strategy = strategy or _cover(params)
    if state is None:
        state = BlockState(block_steps=6)
        strategy.start_block(state, sum(t == 9 for t in tokens))
    n = len(tokens)
    batch = StepBatch(
        logits=torch.tensor(probs).log()[None], tokens=torch.tensor([tokens]),
        valid=torch.ones(1, n, dtype=torch.bool), in_block=torch.ones(1, n, dtype=torch.bool),
        is_gen=torch.ones(1, n, dtype=torch.bool), states=[state],
        temperature=torch.zeros(1, dtype=torch.float64), top_p=torch.ones(1, dtype=torch.float64),
        top_k=torch.full((1,), -1), generators=[torch.Generator()], mask_id=9,
        seeds=torch.tensor([seeds]))
    return decide_now(strategy, batch)


def _none(mask):
    """No position set: `decide` returns None for a remask/replace mask with nothing in it."""
    return mask is None or not bool(mask.any())


def _row(top, p, others=None):
    """A distribution over 10 tokens with p on `top` and the rest spread (or on `others`)."""
    row = [1e-6] * 10
    row[top] = p
    for tok, q in (others or {}).items():
        row[tok] = q
    rest = (1 - sum(row)) / 10
    return [x + rest for x in row]


def test_keep_replace_remask_and_the_progress_guard():
    # positions 0-2 committed seeds, 3-5 masked; the LOO rows of the seeds say:
    # 0: agrees (Keep); 1: another token at 0.98 (Replace); 2: another token at 0.45, nothing
    # by majority (ReMask)
    tokens = [1, 2, 3, 9, 9, 9]
    seeds = [True, True, True, False, False, False]
    probs = [_row(1, 0.9), _row(5, 0.98), _row(6, 0.45, {3: 0.3}),
             _row(4, 0.99), _row(4, 0.99), _row(7, 0.5)]
    every = {"max_revise": None}
    d = _decide_one(tokens, seeds, probs, every)
    assert d.keeps.tolist() == [1] and d.verified.tolist() == [3]
    assert d.replace[0].tolist() == [False, True, False, False, False, False]
    assert d.remask[0].tolist() == [False, False, True, False, False, False]
    assert d.tokens[0, 1] == 5                                   # replaced in place
    assert d.commit[0].tolist() == [False, False, False, True, True, False]   # 0.99 >= 0.97
    # replace_threshold (default 0.5) is the bar: at 0.6 seed 2 is replaced too; with the bar
    # at draft_threshold (null) it is remasked
    probs[2] = _row(6, 0.6, {3: 0.3})
    d = _decide_one(tokens, seeds, probs, every)
    assert d.replace[0].tolist() == [False, True, True, False, False, False]
    assert d.tokens[0, 1:3].tolist() == [5, 6] and _none(d.remask)
    d = _decide_one(tokens, seeds, probs, every | {"replace_threshold": None})
    assert d.remask[0].tolist() == [False, False, True, False, False, False]
    # one draft only: the guard allows max(0, 1 - 1) = 0 remasks, so seed 2 keeps its token
    # for now (counted as unchecked, see below)
    probs[4] = _row(4, 0.5)
    d = _decide_one(tokens, seeds, probs, every | {"replace_threshold": None})
    assert d.commit[0].sum() == 1 and _none(d.remask) and d.keeps.tolist() == [2]
    assert d.replace[0].tolist() == [False, True, False, False, False, False]
    # a verification-only step (no [MASK] left) drafts nothing: it keeps or replaces, never
    # remasks (every such remask on cover-tiny was a flip-flop)
    d = _decide_one([1, 2, 3, 4, 4, 7], [True, True, True, False, False, False], probs,
                    every | {"replace_threshold": None})
    assert not d.commit.any() and _none(d.remask) and d.keeps.tolist() == [2]


def test_one_revision_per_step_and_the_rest_deferred():
    # seeds 1 and 2 both disagree with their tokens; each check assumed the other seed stays,
    # so by default (max_revise=1) only the least likely own token (seed 1) is revised and
    # seed 2 keeps its token but counts as unchecked
    tokens, seeds = [1, 2, 3, 9, 9, 9], [True, True, True, False, False, False]
    probs = [_row(1, 0.9), _row(5, 0.98), _row(6, 0.6, {3: 0.3}),
             _row(4, 0.99), _row(4, 0.99), _row(7, 0.5)]
    strategy, state = _cover(), BlockState(block_steps=6)
    strategy.start_block(state, 3)
    state.extra.memory = CoverMemory.zeros(6)
    state.extra.memory.checks[:] = [2.0, 2.0, 2.0, 0, 0, 0]
    d = _decide_one(tokens, seeds, probs, strategy=strategy, state=state)
    assert d.replace[0].tolist() == [False, True, False, False, False, False]
    assert _none(d.remask) and d.keeps.tolist() == [2]
    checks = state.extra.memory.checks.tolist()
    assert checks[0] == 3 and checks[2] == 0                    # kept seed counted, deferred not


def test_final_verification_waits_only_for_stale_judgements():
    strategy = _cover({"final_verify_below": 1.0, "draft_threshold": 0.9})
    # a block's last [MASK] drafted alone (forced, at 0.5) after its neighbours: its
    # leave-one-out view is the view it was drafted from, so the block ends at once ...
    state = BlockState(block_steps=3)
    strategy.start_block(state, 3)
    probs = [_row(1, 0.99), _row(2, 0.99), _row(4, 0.5)]
    _decide_one([9, 9, 9], [False] * 3, probs, strategy=strategy, state=state)
    mem = state.extra.memory
    mem.age[:] = 1.0                                               # visible once
    assert strategy.select_seeds(state, torch.tensor([1, 2, 9]), 0) == [0]   # k_min = 1
    d = _decide_one([1, 2, 9], [True, False, False], probs, strategy=strategy, state=state)
    assert d.commit[0].tolist() == [False, False, True] and d.keeps.tolist() == [1]
    # ... except for the tokens the draft made stale: 0 and 1 were judged without it
    assert not strategy.block_done(state, 0)
    assert strategy._unverified(mem.conf, mem.stale).tolist() == [True, True, False]
    # a check that keeps both, with nothing else changed, ends the block
    mem.age[:] = 1.0
    assert strategy.select_seeds(state, torch.tensor([1, 2, 4]), 0) == [0, 1]
    d = _decide_one([1, 2, 4], [True, True, False], probs, strategy=strategy, state=state)
    assert d.keeps.tolist() == [2] and strategy.block_done(state, 0)
    # two drafted together were each judged without the other: both wait for a check
    state = BlockState(block_steps=2)
    strategy.start_block(state, 2)
    probs = [_row(3, 0.95), _row(4, 0.95)]
    d = _decide_one([9, 9], [False] * 2, probs, strategy=strategy, state=state)
    assert d.commit[0].tolist() == [True, True] and not strategy.block_done(state, 0)

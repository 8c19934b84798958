"""COVER's vectorised decision against a slow reference written position by position.

`Cover.decide` drafts, judges every seed and advances each request's per-position memory for
the whole batch in a few array operations. The reference below states the same rules one
request, one seed and one position at a time (ALGORITHMS.md §1.3, §1.8; the memory rows of
strategies/cover.py), and the two must agree on random batches: the decision, the memory and
the seed budget.
"""

import math
import random
import zlib

import numpy as np
import pytest
import torch

from cover_vllm.models.spec import ModelSpec
from cover_vllm.strategies import make_params, strategy_class
from cover_vllm.strategies.base import BlockState, StepBatch, decide_now
from cover_vllm.strategies.cover import MEMORY_FIELDS, CoverMemory, CoverState

# the reference keeps COVER's memory as one [6, L] array, rows in the strategy's field order
AGE, CHECKS, CONF, DRIFT, ATTN_IN, STALE = (MEMORY_FIELDS.index(name) for name in (
    "age", "checks", "conf", "drift", "attn_in", "stale"))

MASK, VOCAB = 9, 10


def _least_likely_first(idx, own, k):
    """The k of positions idx with the lowest own probability (ties: lower position)."""
    return set(sorted(idx, key=lambda i: (own[i], i))[:max(k, 0)])


def _reference(p, probs, tokens, seeds, valid, block, mem, extra, drift, attn_in):
    """One request's decision and memory update; probs [W, V] float64 lists, block = (lo, hi)
    in the view. Returns (commit, tokens, remask, replace, keeps, verified) and updates mem
    and extra in place."""
    width = len(tokens)
    lo, hi = block
    best = [max(range(VOCAB), key=lambda v: probs[i][v]) for i in range(width)]
    cand = [valid[i] and lo <= i < hi and tokens[i] == MASK for i in range(width)]
    conf = [probs[i][best[i]] for i in range(width)]
    # drafting: the most confident candidate, plus every candidate at least draft_threshold
    commit = [c and conf[i] >= p.draft_threshold for i, c in enumerate(cand)]
    if any(cand):
        top = max((i for i in range(width) if cand[i]), key=lambda i: (conf[i], -i))
        commit[top] = True
    drafted = sum(commit)
    # verdicts: keep when the leave-one-out argmax is the token (and sure enough), else revise
    # up to max_revise seeds (least likely own tokens first), the rest deferred
    seed_pos = [i for i in range(width) if seeds[i]]
    own = {i: probs[i][tokens[i]] for i in seed_pos}
    keep = {i for i in seed_pos if best[i] == tokens[i] and own[i] >= p.keep_min}
    revise = [i for i in seed_pos if i not in keep]
    limit = len(revise) if p.max_revise is None else p.max_revise
    revised = _least_likely_first(revise, own, limit)
    deferred = set(revise) - revised
    tau_rep = p.draft_threshold if p.replace_threshold is None else p.replace_threshold
    replace = {i for i in revised if best[i] != tokens[i] and conf[i] >= tau_rep}
    unsure = [i for i in revised if i not in replace]
    remask = _least_likely_first(unsure, own, drafted - 1)
    deferred |= set(unsure) - remask
    # memory of the block positions
    fresh = {i for i in range(width) if commit[i]} | replace | remask
    changed = len(fresh)
    for i in range(lo, hi):
        j = i - lo
        visible = valid[i] and tokens[i] != MASK and not seeds[i]
        if i in fresh:
            mem[STALE][j] = float(changed > 1)
        elif i in keep:
            mem[STALE][j] = float(changed > 0)
        else:
            mem[STALE][j] = max(mem[STALE][j], float(changed > 0))
        if drift is not None and visible and mem[AGE][j] >= 1:
            mem[DRIFT][j] = p.drift_beta * mem[DRIFT][j] + (1 - p.drift_beta) * drift[i]
        if attn_in is not None:
            mem[ATTN_IN][j] = attn_in[i]
        if i in keep or i in deferred:
            mem[CONF][j] = own[i]
        elif commit[i]:
            mem[CONF][j] = conf[i]
        elif i in replace:
            mem[CONF][j] = conf[i]
        if i in fresh:
            mem[AGE][j] = mem[CHECKS][j] = mem[DRIFT][j] = 0.0
        else:
            mem[AGE][j] += visible
            mem[CHECKS][j] = 0.0 if i in deferred else mem[CHECKS][j] + seeds[i]
    # seed budget: grows when many checks revised, shrinks when few did
    if seed_pos:
        hit = (len(replace) + len(remask)) / len(seed_pos)
        if hit > p.hit_high:
            extra["rho"] = min(extra["rho"] * (1 + p.rho_eta), p.rho_max)
        elif hit < p.hit_low:
            extra["rho"] = max(extra["rho"] * (1 - p.rho_eta), p.rho_min)
    extra["drafted"] = drafted
    out_tokens = [best[i] if (commit[i] or i in replace) else None for i in range(width)]
    return (commit, out_tokens, [i in remask for i in range(width)],
            [i in replace for i in range(width)], len(keep) + len(deferred), len(seed_pos))


def _random_request(rng):
    """(tokens, seeds, valid, block, logits [W, V], mem, extra, drift, attn_in) of one request."""
    lo, length = rng.randrange(0, 4), rng.randrange(3, 9)
    width = lo + length + rng.randrange(0, 3)
    tokens = [rng.randrange(8) for _ in range(width)]
    for i in range(lo, lo + length):
        if rng.random() < 0.5:
            tokens[i] = MASK
    mem = np.zeros((6, length))
    mem[AGE] = [rng.randrange(3) for _ in range(length)]
    mem[CHECKS] = [rng.randrange(4) for _ in range(length)]
    mem[CONF], mem[DRIFT], mem[ATTN_IN] = (np.array([rng.random() for _ in range(length)])
                                           for _ in range(3))
    mem[STALE] = [rng.randrange(2) for _ in range(length)]
    committed = [i for i in range(lo, lo + length) if tokens[i] != MASK and mem[AGE][i - lo] >= 1]
    seeds = [False] * width
    for i in rng.sample(committed, rng.randrange(len(committed) + 1)):
        seeds[i] = True
    # logits: sharp or flat rows; a seed's row sometimes prefers its own token
    logits = [[rng.gauss(0, 1) * rng.choice((0.5, 2.0, 6.0)) for _ in range(VOCAB)]
              for _ in range(width)]
    for i in range(width):
        if seeds[i] and rng.random() < 0.5:
            logits[i][tokens[i]] += rng.choice((1.0, 8.0))
    extra = {"mem": mem, "rho": rng.choice((0.125, 0.5, 2.0)), "drafted": rng.randrange(4),
             "verify_steps": 0}
    # the statistics come from the model in float32
    drift, attn_in = ([float(np.float32(rng.random())) for _ in range(width)] for _ in range(2))
    return tokens, seeds, [True] * width, (lo, lo + length), logits, mem, extra, drift, attn_in


@pytest.mark.parametrize("params", [
    {}, {"draft_threshold": 0.5}, {"max_revise": None, "replace_threshold": None},
    {"max_revise": 2, "keep_min": 0.6, "draft_threshold": 0.3},
    {"replace_threshold": 0.2, "w_influence": 0.0, "w_drift": 0.0},
])
def test_decide_matches_the_reference_on_random_batches(params):
    spec = ModelSpec(family="llada", vocab_size=VOCAB, mask_token_id=MASK, eos_token_ids=(8,),
                     pad_token_id=8, logit_shift=0, max_model_len=64)
    strategy = strategy_class("cover")(make_params("cover", params), spec)
    p = strategy.params
    rng = random.Random(zlib.crc32(repr(sorted(params.items())).encode()))
    verdicts = {"commit": 0, "remask": 0, "replace": 0}
    for _ in range(60):
        reqs = [_random_request(rng) for _ in range(rng.randrange(1, 4))]
        width = max(len(r[0]) for r in reqs)
        n = len(reqs)
        pad = lambda rows, fill: [row + [fill] * (width - len(row)) for row in rows]  # noqa: E731
        logits = torch.tensor([r[4] + [[0.0] * VOCAB] * (width - len(r[4])) for r in reqs],
                              dtype=torch.float32)
        logits[..., MASK] = float("-inf")              # as the engine does: never a proposal
        in_block = [[r[3][0] <= i < r[3][1] for i in range(width)] for r in reqs]
        states = []
        for r in reqs:
            st = BlockState(block_steps=8)
            saved = r[6]
            st.extra = CoverState(rho=saved["rho"], drafted=saved["drafted"],
                                  verify_steps=saved["verify_steps"],
                                  memory=CoverMemory.of(saved["mem"].copy()))
            states.append(st)
        with_stats = rng.random() < 0.7
        batch = StepBatch(
            logits=logits, tokens=torch.tensor(pad([r[0] for r in reqs], MASK)),
            valid=torch.tensor(pad([r[2] for r in reqs], False)),
            in_block=torch.tensor(in_block), is_gen=torch.tensor(in_block), states=states,
            temperature=torch.zeros(n, dtype=torch.float64),
            top_p=torch.ones(n, dtype=torch.float64), top_k=torch.full((n,), -1),
            generators=[torch.Generator() for _ in reqs], mask_id=MASK,
            seeds=torch.tensor(pad([r[1] for r in reqs], False)),
            drift=torch.tensor(pad([r[7] for r in reqs], 0.0)) if with_stats else None,
            attn_in=torch.tensor(pad([r[8] for r in reqs], 0.0)) if with_stats else None)
        d = decide_now(strategy, batch)
        probs = torch.softmax(logits.to(torch.float64), dim=-1).tolist()
        for row, r in enumerate(reqs):
            tokens, seeds, valid, block, _, mem, extra, drift, attn_in = r
            w = len(tokens)
            commit, out, remask, replace, keeps, verified = _reference(
                p, probs[row][:w], tokens, seeds, valid, block, mem, extra,
                drift if with_stats else None, attn_in if with_stats else None)
            assert d.commit[row, :w].tolist() == commit
            got = d.tokens[row, :w].tolist()
            assert [g if o is not None else None for g, o in zip(got, out)] == out
            none = lambda m: [False] * w if m is None else m[row, :w].tolist()  # noqa: E731
            assert none(d.remask) == remask and none(d.replace) == replace
            assert (int(d.keeps[row]), int(d.verified[row])) == (keeps, verified)
            got = states[row].extra
            np.testing.assert_allclose(got.memory.stacked(), mem, rtol=1e-12, atol=1e-12)
            assert got.drafted == extra["drafted"]
            assert math.isclose(got.rho, extra["rho"])
            # a step that leaves no [MASK] in the block counts towards max_verify_steps
            lo, hi = block
            left = sum((tokens[i] == MASK and not commit[i]) or remask[i] for i in range(lo, hi))
            assert got.verify_steps == extra["verify_steps"] + (left == 0)
            verdicts["commit"] += sum(commit)
            verdicts["remask"] += sum(remask)
            verdicts["replace"] += sum(replace)
    assert verdicts["commit"] > 0 and verdicts["replace"] > 0       # the cases were exercised
    if params.get("replace_threshold", 0.5) is None or params.get("keep_min"):
        assert verdicts["remask"] > 0


def _reference_seeds(p, tokens, mem, rho, drafted):
    """One request's seeds from its block tokens [B] and memory [6, B] (ALGORITHMS.md §1.6,
    §1.7), one position at a time: block positions, ascending."""
    n = len(tokens)
    below = p.draft_threshold if p.final_verify_below is None else p.final_verify_below
    visible = [tokens[i] != MASK and mem[AGE][i] >= 1 for i in range(n)]
    cand = [visible[i] and (p.max_verifications is None or mem[CHECKS][i] < p.max_verifications)
            for i in range(n)]
    pending = [False] * n
    if MASK not in tokens:          # verification only: every stale, unsure token, first
        pending = [visible[i] and mem[CONF][i] < below and mem[STALE][i] > 0 for i in range(n)]
        cand = [c or q for c, q in zip(cand, pending)]
    num = sum(cand)
    if num == 0 or p.k_max == 0:
        return []
    want = sum(pending) if MASK not in tokens else math.ceil(rho * drafted)
    k = min(max(want, p.k_min), p.k_max, num)

    def normalised(values):
        lo = min(values[i] for i in range(n) if cand[i])
        span = max(values[i] for i in range(n) if cand[i]) - lo
        return [(v - lo) / span if span > 0 else 0.0 for v in values]

    u = normalised([1.0 - c for c in mem[CONF]])
    d_in, drift = normalised(list(mem[ATTN_IN])), normalised(list(mem[DRIFT]))
    score = [p.w_uncertainty * u[i] + p.w_influence * d_in[i] + p.w_drift * drift[i]
             + (10.0 if pending[i] else 0.0) for i in range(n)]
    return sorted(sorted((i for i in range(n) if cand[i]), key=lambda i: (-score[i], i))[:k])


@pytest.mark.parametrize("params", [
    {}, {"k_max": 2, "k_min": 0}, {"max_verifications": None, "final_verify_below": 1.0},
    {"w_influence": 0.0, "w_drift": 0.0, "rho_max": 2.0}, {"k_max": 0, "k_min": 0},
])
def test_batched_seed_selection_matches_the_reference(params):
    """`Cover.plan_seeds` picks every request's seeds of a step at once, from rows of one
    memory table; the per-request rules above must give the same seeds."""
    spec = ModelSpec(family="llada", vocab_size=VOCAB, mask_token_id=MASK, eos_token_ids=(8,),
                     pad_token_id=8, logit_shift=0, max_model_len=64)
    strategy = strategy_class("cover")(make_params("cover", params), spec)
    rng = random.Random(zlib.crc32(repr(sorted(params.items())).encode()))
    picked_any = verify_only = 0
    for _ in range(80):
        states, canvases, blocks, want = [], [], [], []
        for _ in range(rng.randrange(1, 5)):
            prompt, length = rng.randrange(0, 5), rng.randrange(1, 10)
            masked = rng.random() < 0.6
            block = [MASK if masked and rng.random() < 0.4 else rng.randrange(8)
                     for _ in range(length)]
            canvas = ([rng.randrange(8) for _ in range(prompt)] + block
                      + [MASK] * rng.randrange(0, 6))
            mem = np.zeros((6, length))
            mem[AGE] = [rng.randrange(3) for _ in range(length)]
            mem[CHECKS] = [rng.randrange(5) for _ in range(length)]
            mem[CONF] = [rng.choice((0.5, 0.99, rng.random())) for _ in range(length)]
            mem[DRIFT], mem[ATTN_IN] = (np.array([rng.choice((0.0, rng.random()))
                                                  for _ in range(length)]) for _ in range(2))
            mem[STALE] = [rng.randrange(2) for _ in range(length)]
            rho, drafted = rng.choice((0.125, 0.5, 2.0)), rng.randrange(5)
            states.append(BlockState(block_steps=8, extra=CoverState(
                rho=rho, drafted=drafted, memory=CoverMemory.of(mem.copy()))))
            canvases.append(torch.tensor(canvas))
            blocks.append((prompt, prompt + length))
            want.append([prompt + i for i in _reference_seeds(strategy.params, block, mem, rho,
                                                               drafted)])
            verify_only += MASK not in block
        got = strategy.plan_seeds(states, canvases, blocks)
        assert got == want
        picked_any += sum(map(len, got))
        for st, canvas, (start, end), seeds in zip(states, canvases, blocks, want):
            assert strategy.select_seeds(st, canvas[start:end], start) == seeds   # alone
    assert verify_only > 0
    assert picked_any > 0 or strategy.params.k_max == 0

"""`llada2`, `llada2_edit` and `sdar` on hand-made steps: schedules, thresholds, edits, post
steps, early stop, params. (Batched == per-row for all three: tests/test_strategies.py; the golden
cases: tests/test_golden_block_reference.py and test_golden_block_generate.py.)"""

from __future__ import annotations

import pytest
import torch

from cover_vllm.models.spec import ModelSpec
from cover_vllm.strategies import BlockState, StepBatch, decide_now, make_params, strategy_class
from cover_vllm.strategies.llada2 import block_schedule
from cover_vllm.strategies.sampling import token_prob

V, MASK, EOS = 8, 7, 6
M = MASK
SPEC = ModelSpec(family="llada2", vocab_size=V, mask_token_id=MASK, eos_token_ids=(EOS,),
                 pad_token_id=EOS, logit_shift=0, max_model_len=256, default_block_length=32)


def make(name: str, **params):
    return strategy_class(name)(make_params(name, params or None), SPEC)


def state(strategy, tokens: list[int], block_size: int | None = None, steps: int | None = None,
          max_tokens: int = 64) -> BlockState:
    st = BlockState(block_steps=0, block_size=block_size or len(tokens), max_tokens=max_tokens,
                    steps=steps)
    strategy.start_block(st, tokens.count(MASK))
    return st


def batch(rows: list[tuple[list[int], list[tuple[int, float]]]],
          states: list[BlockState]) -> StepBatch:
    """rows: (block tokens, (argmax token, its probability) per slot); the block is the view."""
    n, width = len(rows), max(len(t) for t, _ in rows)
    logits = torch.zeros(n, width, V)
    tokens = torch.full((n, width), MASK)
    valid = torch.zeros(n, width, dtype=torch.bool)
    for i, (toks, preds) in enumerate(rows):
        for j, (tok, p) in enumerate(preds):
            probs = torch.full((V,), (1 - p) / (V - 2))
            probs[tok], probs[MASK] = p, 0.0
            logits[i, j] = probs.log()                  # [MASK] logit -inf, as the engine's
        tokens[i, : len(toks)] = torch.tensor(toks)
        valid[i, : len(toks)] = True
    return StepBatch(logits=logits, tokens=tokens, valid=valid, in_block=valid.clone(),
                     is_gen=valid.clone(), states=states,
                     temperature=torch.zeros(n, dtype=torch.float64),
                     top_p=torch.ones(n, dtype=torch.float64), top_k=torch.full((n,), -1),
                     generators=[torch.Generator() for _ in range(n)], mask_id=MASK)


def commits(decision, row: int = 0) -> list[int]:
    return decision.commit[row].nonzero().flatten().tolist()


def step(strategy, st: BlockState, toks: list[int], preds) -> tuple[object, list[int]]:
    """One decision on one request; returns it and the block after applying it."""
    d = decide_now(strategy, batch([(toks, preds)], [st]))
    change = d.commit[0] | (d.replace[0] if d.replace is not None else False)
    out = [int(d.tokens[0, j]) if change[j] else t for j, t in enumerate(toks)]
    st.step += 1
    return d, out


@pytest.mark.parametrize("size,steps,expect", [
    (8, 8, [1] * 8), (8, 3, [3, 3, 2]), (32, 6, [6, 6, 5, 5, 5, 5]), (4, 6, [1, 1, 1, 1, 0, 0])])
def test_block_schedule_is_the_official_one(size, steps, expect):
    assert block_schedule(size, steps) == expect


def test_llada2_schedule_spans_the_block_length_and_caps_steps():
    s = make("llada2")
    # a first block holding the prompt's tail: 3 masks of a block of 8, steps 4 -> 2 per step
    assert state(s, [M, M, M], block_size=8, steps=4).extra.schedule == [2, 2, 2, 2]
    # steps = min(steps, max_tokens // minimal_topk); unset steps: the reference's 32
    s8 = make("llada2", minimal_topk=8)
    assert state(s8, [M] * 8, steps=32, max_tokens=32).extra.schedule == [2, 2, 2, 2]
    assert len(state(s, [M] * 8, steps=None, max_tokens=20).extra.schedule) == 20
    assert len(state(s, [M] * 8, steps=None, max_tokens=64).extra.schedule) == 32


def test_llada2_commits_every_mask_above_threshold_or_the_top_count():
    s = make("llada2", threshold=0.5)
    toks = [M, M, M, M]
    preds = [(1, 0.9), (2, 0.6), (3, 0.55), (4, 0.3)]
    d, _ = step(s, state(s, toks, steps=4), toks, preds)          # n = 1, three above 0.5
    assert commits(d) == [0, 1, 2] and d.tokens[0, :3].tolist() == [1, 2, 3]
    preds = [(1, 0.9), (2, 0.4), (3, 0.45), (4, 0.3)]
    d, _ = step(s, state(s, toks, steps=2), toks, preds)          # n = 2, one above: top 2
    assert commits(d) == [0, 2]
    d, _ = step(s, state(s, [5, M, 5, M], steps=1), [5, M, 5, M], preds)   # n = 4 > masks
    assert commits(d) == [1, 3]


def test_llada2_threshold_is_strict():
    toks, preds = [M, M, M], [(1, 0.8), (2, 0.7), (3, 0.2)]
    conf = token_prob(batch([(toks, preds)], [None]).logits, torch.tensor([[1, 2, 3]]))
    at = float(conf[0, 1])                                # exactly slot 1's float32 confidence
    s = make("llada2", threshold=at)
    d, _ = step(s, state(s, toks, block_size=3, steps=3), toks, preds)   # n = 1, one above
    assert commits(d) == [0]                              # slot 1 (== threshold) is not above
    s = make("llada2", threshold=float(torch.tensor(at).nextafter(torch.tensor(0.0))))
    d, _ = step(s, state(s, toks, block_size=3, steps=3), toks, preds)   # n = 1, two above
    assert commits(d) == [0, 1]


def test_llada2_block_ends_when_filled_or_out_of_steps():
    s = make("llada2", threshold=2.0)                     # never crossed: pure schedule
    st = state(s, [M] * 4, steps=2)
    assert not s.block_done(st, 4)
    st.step = 1
    assert s.block_done(st, 0) and not s.block_done(st, 2)
    st.step = 2
    assert s.block_done(st, 2)                            # budget spent (masks stay)


def test_llada2_eos_early_stop():
    s = make("llada2", threshold=0.5, eos_early_stop=True)
    toks = [5, M, M, M]
    d, _ = step(s, state(s, toks), toks, [(5, 0.9), (EOS, 0.9), (2, 0.2), (3, 0.2)])
    assert d.stop.tolist() == [True]                      # EOS committed, nothing masked before
    toks = [M, M, M, M]
    d, _ = step(s, state(s, toks), toks, [(1, 0.2), (EOS, 0.9), (2, 0.2), (3, 0.2)])
    assert d.stop.tolist() == [False]                     # slot 0 still [MASK] before the EOS
    toks = [EOS, 4, M, M]
    d, _ = step(s, state(s, toks), toks, [(1, 0.2), (1, 0.2), (2, 0.9), (3, 0.2)])
    assert d.stop.tolist() == [False]                     # no EOS committed by this step
    quiet = make("llada2", threshold=0.5)
    d, _ = step(quiet, state(quiet, [M, M]), [M, M], [(EOS, 0.9), (2, 0.9)])
    assert d.stop is None and quiet.eos_ends_request


def test_llada2_steps_and_block_length_checks():
    s = make("llada2", minimal_topk=8)
    s.check_steps(1000, 8)                                # steps are per block: any count
    with pytest.raises(ValueError, match="minimal_topk"):
        s.check_steps(None, 7)
    assert s.default_block_length(8) == 32                # never capped at max_tokens


def test_llada2_edit_commits_and_edits_in_one_forward():
    s = make("llada2_edit", threshold=0.5, editing_threshold=0.8, num_to_transfer=1)
    toks = [4, 5, M, M]
    preds = [(1, 0.9), (5, 0.95), (2, 0.9), (3, 0.3)]
    d, out = step(s, state(s, toks), toks, preds)
    assert commits(d) == [2]
    assert d.replace[0].nonzero().flatten().tolist() == [0]   # 4 -> 1; slot 1 is unchanged
    assert out == [1, 5, 2, M]
    preds = [(1, 0.5), (5, 0.5), (6, 0.99), (3, 0.9)]         # slot 2 just committed: no edit
    toks = [1, 5, M, M]
    d, out = step(s, state(s, toks), toks, preds)
    assert commits(d) == [2, 3] and not d.replace.any()


def test_llada2_edit_verification_forward_and_post_steps():
    s = make("llada2_edit", threshold=0.5, editing_threshold=0.8, max_post_steps=2)
    st = state(s, [M, M])
    _, out = step(s, st, [M, M], [(1, 0.9), (2, 0.9)])       # fills the block
    assert out == [1, 2] and not s.block_done(st, 0)          # a verification forward follows
    _, out = step(s, st, out, [(3, 0.9), (2, 0.9)])           # post step 1 edits slot 0
    assert out == [3, 2] and not s.block_done(st, 0)
    _, out = step(s, st, out, [(4, 0.9), (2, 0.9)])           # post step 2 edits again
    assert out == [4, 2] and s.block_done(st, 0)              # post step 3 > 2: no forward
    st = state(s, [M, M])
    _, out = step(s, st, [M, M], [(1, 0.9), (2, 0.9)])
    _, out = step(s, st, out, [(1, 0.9), (2, 0.9)])           # verification: no edit
    assert s.block_done(st, 0) and st.step == 2
    none = make("llada2_edit", max_post_steps=0)
    st = state(none, [M])
    step(none, st, [M], [(1, 0.99)])
    assert none.block_done(st, 0)                             # no verification forward at all


def test_llada2_edit_eos_and_steps():
    assert not make("llada2_edit").eos_ends_request          # every block is generated
    assert make("llada2_edit", eos_early_stop=True).eos_ends_request
    make("llada2_edit").check_steps(10_000, 4)                # `steps` is dead in LLaDA2.1


def test_sdar_sequential_fills_a_slice_from_the_first_mask():
    s = make("sdar", remasking="sequential")
    toks = [5, 5, M, M, M, M]                                 # 6 slots of a block of 8
    st = state(s, toks, block_size=8, steps=3)                # schedule [3, 3, 2]
    d, out = step(s, st, toks, [(1, 0.3)] * 6)
    assert commits(d) == [2, 3, 4] and out == [5, 5, 1, 1, 1, M]
    d, out = step(s, st, out, [(2, 0.3)] * 6)                 # 3 asked, 1 left: clipped
    assert commits(d) == [5] and s.block_done(st, 0)


def test_sdar_static_and_dynamic():
    toks, preds = [M, M, M, M], [(1, 0.9), (2, 0.95), (3, 0.4), (4, 0.6)]
    static = make("sdar", remasking="low_confidence_static")
    d, _ = step(static, state(static, toks, steps=2), toks, preds)     # top 2
    assert commits(d) == [0, 1]
    dynamic = make("sdar", threshold=0.5)
    d, _ = step(dynamic, state(dynamic, toks, steps=4), toks, preds)   # 3 above 0.5 >= 1
    assert commits(d) == [0, 1, 3]
    d, _ = step(dynamic, state(dynamic, toks, steps=1), toks, preds)   # 3 above < 4: top 4
    assert commits(d) == [0, 1, 2, 3]
    # the official top_k=1 runs (confidence 1.0 everywhere) == threshold 0: all at once
    zero = make("sdar", threshold=0.0)
    d, _ = step(zero, state(zero, toks, steps=4), toks, [(1, 0.2)] * 4)
    assert commits(d) == [0, 1, 2, 3]


def test_sdar_past_its_schedule_reveals_everything_left():
    s = make("sdar", remasking="low_confidence_static")
    st = state(s, [M, M, M], block_size=8, steps=8)           # [1] * 8
    st.step = 8
    d, _ = step(s, st, [M, M, M], [(1, 0.3)] * 3)
    assert commits(d) == [0, 1, 2]
    assert s.default_block_length(2) == 32
    s.check_steps(500, 4)


@pytest.mark.parametrize("name,params,field", [
    ("llada2", {"minimal_topk": 0}, "minimal_topk"),
    ("llada2", {"threshold": "high"}, "threshold"),
    ("llada2", {"threshold": float("nan")}, "threshold"),
    ("llada2_edit", {"num_to_transfer": 0}, "num_to_transfer"),
    ("llada2_edit", {"max_post_steps": -1}, "max_post_steps"),
    ("llada2_edit", {"editing_threshold": float("nan")}, "editing_threshold"),
    ("sdar", {"remasking": "entropy_bounded"}, "remasking"),
])
def test_bad_params(name, params, field):
    with pytest.raises((ValueError, TypeError), match=field):
        make_params(name, params)


def test_defaults_are_the_official_functions():
    assert make_params("llada2", None) == make_params(
        "llada2", {"threshold": 0.95, "minimal_topk": 1, "eos_early_stop": False})
    assert make_params("llada2_edit", None) == make_params("llada2_edit", {
        "threshold": 0.95, "editing_threshold": 0.9, "max_post_steps": 16,
        "num_to_transfer": 1, "eos_early_stop": False})
    assert make_params("sdar", None) == make_params(
        "sdar", {"remasking": "low_confidence_dynamic", "threshold": 0.85})

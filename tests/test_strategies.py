"""Every registered strategy decides the same for a request batched as alone; registry errors."""

import copy
import dataclasses

import numpy as np
import pytest
import torch

from cover_vllm.models.spec import ModelSpec
from cover_vllm.strategies import (STRATEGIES, BlockState, StepBatch, decide_now, make_params,
                                   strategy_class)

V = 16                                   # vocab; the last id is [MASK]
MASK = V - 1
WIDTHS = [7, 12, 5, 9]                   # view width of each of the 4 requests
WARMUP = [0, 2, 1, 3]                    # steps each request takes alone before the comparison
STEPS = [4, 3, 6, 2]                     # steps budgeted for each request's block

# Extra knobs tried on top of the defaults (strategies registered later run with defaults).
VARIANTS = {
    "threshold": [{"threshold": 0.5}, {"threshold": None}],
    "factor": [{"factor": 2.0}],
    "low_confidence": [{"cfg_scale": 1.0}],
    "maskgit_plus": [{"alg_temp": 0.5}],
    "topk_margin": [{"alg_temp": 0.2}],
    "entropy": [{"alg_temp": 1.0}, {"eps": 0.1}],
    "saber": [{"n": 3}, {"n": 1}, {"eos_penalty": 0.5}],
    "wino": [{"threshold": 0.3, "threshold_back": 0.99}, {"initial_last_accept": 2}],
    "asrd": [{"anchor_steps": 1, "anchor_threshold": 0.2, "max_draft": 2}],
    "llada2": [{"threshold": 0.3, "eos_early_stop": True}, {"threshold": 2.0, "minimal_topk": 3}],
    "llada2_edit": [{"threshold": 0.3, "editing_threshold": 0.2, "num_to_transfer": 2,
                     "max_post_steps": 1, "eos_early_stop": True}],
    "sdar": [{"remasking": "sequential"}, {"remasking": "low_confidence_static"},
             {"threshold": 0.3}],
}
CASES = [(name, params) for name in sorted(STRATEGIES)
         for params in [None] + VARIANTS.get(name, [])]


def _spec(quota: bool) -> ModelSpec:
    """A tiny spec; `quota` flips the family facts strategies read (Fast-dLLM Dream quota,
    Saber's Dream decoder)."""
    return ModelSpec(family="dream" if quota else "llada", vocab_size=V, mask_token_id=MASK,
                     eos_token_ids=(V - 2,), pad_token_id=V - 2, logit_shift=int(quota),
                     max_model_len=128, threshold_quota=quota, saber_dream=quota)


class Req:
    """One hand-built request: view logits/tokens, block bounds, sampling knobs, state, RNG."""

    def __init__(self, i: int, strategy, hot: bool):
        g = torch.Generator().manual_seed(100 + i)
        w = WIDTHS[i]
        self.logits = 3 * torch.randn(w, V, generator=g)              # sharp: thresholds bite
        self.logits[:, MASK] = float("-inf")
        self.block = (1, w - 1) if i % 2 else (0, w)                  # odd: context both sides
        self.tokens = torch.full((w,), MASK)
        self.tokens[: self.block[0]] = 3
        committed = torch.rand(w, generator=g) < 0.25                 # a few already revealed
        self.tokens[committed & (torch.arange(w) < self.block[1])] = 5
        self.is_gen = torch.arange(w) >= (1 if i % 2 else 0)
        self.temperature = [0.7, 0.0, 1.3, 0.5][i] if hot else 0.0
        self.top_p, self.top_k = [1.0, 0.9, 1.0, 0.8][i], [-1, 5, 3, -1][i]
        start, end = self.block
        self.state = BlockState(block_steps=STEPS[i], block_size=end - start, max_tokens=w,
                                steps=STEPS[i])     # the engine fills these for every request
        strategy.start_block(self.state, int((self.tokens[start:end] == MASK).sum()))
        self.generator = torch.Generator().manual_seed(7 + i)
        # logits of extra query rows (WINO's shadow block: one row per block slot)
        self.extra = 3 * torch.randn(end - start, V, generator=torch.Generator().manual_seed(i))
        # the [MASK] column before the engine's -inf (confidences read it: #48)
        self.mask_logits = 3 * torch.randn(w, generator=torch.Generator().manual_seed(50 + i))


def _batch(reqs: list[Req], generators: list[torch.Generator]) -> StepBatch:
    n, width = len(reqs), max(r.tokens.numel() for r in reqs)
    logits = torch.zeros(n, width, V)
    tokens = torch.full((n, width), MASK)
    valid, in_block, is_gen = (torch.zeros(n, width, dtype=torch.bool) for _ in range(3))
    for i, r in enumerate(reqs):
        w = r.tokens.numel()
        logits[i, :w], tokens[i, :w], is_gen[i, :w] = r.logits, r.tokens, r.is_gen
        valid[i, :w] = True
        in_block[i, r.block[0]:r.block[1]] = True
    mask_logits = torch.zeros(n, width)
    for i, r in enumerate(reqs):
        mask_logits[i, : r.tokens.numel()] = r.mask_logits
    extra = torch.zeros(n, max(r.extra.shape[0] for r in reqs), V)
    extra_valid = torch.zeros(extra.shape[:2], dtype=torch.bool)
    for i, r in enumerate(reqs):
        extra[i, : r.extra.shape[0]], extra_valid[i, : r.extra.shape[0]] = r.extra, True
    return StepBatch(
        logits=logits, tokens=tokens, valid=valid, in_block=in_block, is_gen=is_gen,
        states=[r.state for r in reqs],
        temperature=torch.tensor([r.temperature for r in reqs], dtype=torch.float64),
        top_p=torch.tensor([r.top_p for r in reqs], dtype=torch.float64),
        top_k=torch.tensor([r.top_k for r in reqs], dtype=torch.long),
        generators=generators, mask_id=MASK, extra_logits=extra, extra_valid=extra_valid,
        mask_logits=mask_logits)


def _rows(decision, i: int, w: int) -> dict:
    """Request i's part of a decision as plain lists (None flags read as all False, counts 0)."""
    flag = lambda t: [False] * w if t is None else t[i, :w].tolist()  # noqa: E731
    count = lambda t: 0 if t is None else int(t[i])  # noqa: E731
    commit, replace = flag(decision.commit), flag(decision.replace)
    tokens = decision.tokens[i, :w].tolist()
    return {"commit": commit, "remask": flag(decision.remask), "replace": replace,
            "tokens": [t if c or r else None for t, c, r in zip(tokens, commit, replace)],
            "keeps": count(decision.keeps), "verified": count(decision.verified),
            "stop": decision.stop is not None and bool(decision.stop[i])}


def _apply(req: Req, row: dict) -> None:
    for j in range(req.tokens.numel()):
        if row["remask"][j]:
            req.tokens[j] = MASK
        if row["commit"][j] or row["replace"][j]:
            req.tokens[j] = row["tokens"][j]
    req.state.step += 1


def _copy_generator(g: torch.Generator) -> torch.Generator:
    out = torch.Generator()
    out.set_state(g.get_state())
    return out


def _comparable(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", value.tolist())
    if isinstance(value, np.ndarray):
        return ("array", value.tolist())
    if dataclasses.is_dataclass(value):
        return (type(value).__name__, _comparable(vars(value)))
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_comparable(v) for v in value]
    return value


@pytest.mark.parametrize("hot", [False, True], ids=["T0", "T>0"])
@pytest.mark.parametrize("quota", [False, True], ids=["llada_spec", "dream_spec"])
@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_batched_decision_equals_per_row(name, params, quota, hot):
    if name == "saber" and params and params.get("eos_penalty") and not quota:
        pytest.skip("eos_penalty belongs to Saber's Dream decoder (see the test below)")
    strategy = strategy_class(name)(make_params(name, params), _spec(quota))
    reqs = [Req(i, strategy, hot) for i in range(4)]
    for r, warmup in zip(reqs, WARMUP):                 # different states: steps taken alone
        for _ in range(warmup):
            _apply(r, _rows(decide_now(strategy, _batch([r], [r.generator])), 0, r.tokens.numel()))
    alone = copy.deepcopy(reqs)
    batch_gens = [_copy_generator(r.generator) for r in reqs]
    batched = decide_now(strategy, _batch(reqs, batch_gens))
    for i, r in enumerate(alone):
        w = r.tokens.numel()
        single = _rows(decide_now(strategy, _batch([r], [r.generator])), 0, w)
        assert _rows(batched, i, w) == single, f"request {i}"
        assert _comparable(reqs[i].state.extra) == _comparable(r.state.extra), f"state {i}"
        assert _comparable(reqs[i].state.memory) == _comparable(r.state.memory), f"memory {i}"
        assert torch.equal(batch_gens[i].get_state(), r.generator.get_state()), f"stream {i}"


@pytest.mark.parametrize("hot", [False, True], ids=["T0", "T>0"])
@pytest.mark.parametrize("quota", [False, True], ids=["llada_spec", "dream_spec"])
@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_device_path_decides_as_the_cpu_path(name, params, quota, hot):
    """The path a GPU takes (every view row read, `dense_rows`) gives the CPU's compact path's
    decision, state and random stream, step after step."""
    from cover_vllm.strategies.sampling import dense_rows

    if name == "saber" and params and params.get("eos_penalty") and not quota:
        pytest.skip("eos_penalty belongs to Saber's Dream decoder")
    strategy = strategy_class(name)(make_params(name, params), _spec(quota))
    compact = [Req(i, strategy, hot) for i in range(4)]
    dense = copy.deepcopy(compact)
    for _ in range(3):
        batch = _batch(compact, [r.generator for r in compact])
        want = decide_now(strategy, batch)
        with dense_rows():
            got = decide_now(strategy, _batch(dense, [r.generator for r in dense]))
        for i, (a, b) in enumerate(zip(compact, dense)):
            w = a.tokens.numel()
            assert _rows(got, i, w) == _rows(want, i, w), f"request {i}"
            assert _comparable(a.state.extra) == _comparable(b.state.extra), f"state {i}"
            assert _comparable(a.state.memory) == _comparable(b.state.memory), f"memory {i}"
            assert torch.equal(a.generator.get_state(), b.generator.get_state()), f"stream {i}"
            _apply(a, _rows(want, i, w))
            _apply(b, _rows(got, i, w))


def test_saber_eos_penalty_needs_the_dream_rules():
    with pytest.raises(ValueError, match="eos_penalty"):
        strategy_class("saber")(make_params("saber", {"eos_penalty": 0.5}), _spec(False))
    with pytest.raises(ValueError, match="n must be"):
        make_params("saber", {"n": 0})


def test_unknown_strategy_lists_the_valid_names():
    with pytest.raises(ValueError) as err:
        strategy_class("no_such_decoder")
    for name in STRATEGIES:
        assert name in str(err.value)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_make_params_rejects_unknown_keys_naming_the_allowed(name):
    with pytest.raises(ValueError) as err:
        make_params(name, {"no_such_knob": 1})
    assert "no_such_knob" in str(err.value)
    for field in strategy_class(name).params_cls.__dataclass_fields__:
        assert field in str(err.value)


@pytest.mark.parametrize("name,params,field", [
    ("entropy", {"eps": 1.0}, "eps"), ("maskgit_plus", {"eps": -0.1}, "eps"),
    ("topk_margin", {"alg_temp": -1.0}, "alg_temp"), ("threshold", {"threshold": 1.5}, "threshold"),
])
def test_bad_params_values(name, params, field):
    with pytest.raises(ValueError, match=field):
        make_params(name, params)


@pytest.mark.parametrize("name,blocks", [("entropy", 1), ("maskgit_plus", 1), ("topk_margin", 1),
                                         ("low_confidence", 2), ("threshold", 2),
                                         ("saber", 1)])
def test_default_block_length(dream_dir, name, blocks):
    """Dream's decoders default to one block (the reference has none); others use the model's."""
    from cover_vllm import SamplingParams
    from cover_vllm.scheduler.request import Request

    spec = ModelSpec.from_dir(dream_dir)
    strategy = strategy_class(name)(make_params(name, None), spec)
    params = SamplingParams(max_tokens=2 * spec.default_block_length, decoding=name)
    req = Request("r", None, [1, 2, 3], params, strategy, torch.Generator(), "none")
    assert len(req.blocks) == blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_greedy_scored_proposal_matches_the_general_path(dtype):
    """`propose_scored`'s greedy fast path (one compact copy of the candidate rows) gives the
    bits of `propose` + `token_prob`, ties included (logits rounded through bf16 tie often)."""
    from cover_vllm.strategies.llada import propose, propose_scored
    from cover_vllm.strategies.sampling import token_prob

    gen = torch.Generator().manual_seed(0)
    n, w, v = 5, 12, 300
    logits = (torch.randn(n, w, v, generator=gen) * 3).to(torch.bfloat16).float()
    logits[1, 2] = 0.0                                     # a row that is all one tie
    rows = torch.rand(n, w, generator=gen) < 0.6

    def batch(temperature: float) -> StepBatch:
        return StepBatch(
            logits=logits, tokens=torch.full((n, w), MASK), valid=torch.ones(n, w, dtype=bool),
            in_block=torch.ones(n, w, dtype=bool), is_gen=torch.ones(n, w, dtype=bool),
            states=[None] * n, temperature=torch.full((n,), temperature, dtype=torch.float64),
            top_p=torch.ones(n, dtype=torch.float64), top_k=torch.full((n,), -1),
            generators=[torch.Generator().manual_seed(i) for i in range(n)], mask_id=MASK)

    tokens, probs = propose_scored(batch(0.0), rows, dtype)
    ref_tokens, ref_logits = propose(batch(0.0), rows=rows)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(probs, token_prob(ref_logits, ref_tokens, dtype, rows=rows))
    assert int(tokens[1, 2]) == 0 or not bool(rows[1, 2])     # first index of the tie
    hot_tokens, hot_probs = propose_scored(batch(1.0), rows, dtype)   # the general path
    assert hot_probs.dtype == dtype and bool((hot_probs[rows] > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_chunked_greedy_equals_max_indices(dtype):
    """`greedy`'s CPU path (chunk maxima, then the first chunk holding the row's maximum) gives
    `max(dim)`'s indices bit for bit: ties across and within chunks go to the first index, a
    row of -inf gives 0, a NaN wins as it does in `max`; a vocabulary that does not split into
    chunks, and a non-contiguous tensor, take `max(dim)` itself."""
    from cover_vllm.strategies.sampling import GREEDY_CHUNK, greedy

    gen = torch.Generator().manual_seed(0)
    v = 8 * GREEDY_CHUNK
    logits = torch.randint(0, 4, (6, 7, v), generator=gen).to(dtype)   # ties everywhere
    logits[0, 0] = float("-inf")
    logits[0, 1, 5 * GREEDY_CHUNK + 3] = float("nan")
    logits[0, 1, 6 * GREEDY_CHUNK] = float("nan")
    logits[0, 2, -1] = 9.0                                 # the last column
    for x in (logits, torch.randn(40, v, generator=gen).to(dtype), logits[:, :, :v - 4],
              logits.transpose(0, 1), logits[:0]):
        assert torch.equal(greedy(x), x.max(dim=-1).indices)
    assert int(greedy(logits)[0, 1]) == 5 * GREEDY_CHUNK + 3


def _ranked_scores(gen: torch.Generator) -> torch.Tensor:
    """[9, 12] float64 probabilities with ties, -inf for "none", a row of -inf and NaN rows:
    the scores COVER's masks rank (never +inf)."""
    scores = torch.randint(0, 5, (9, 12), generator=gen).double() / 4     # ties everywhere
    scores[torch.rand(9, 12, generator=gen) < 0.3] = float("-inf")
    scores[1] = float("-inf")
    scores[2, 4] = float("nan")
    scores[3] = float("nan")
    scores[4, :3] = 1.0                                   # three tied maxima: the first wins
    return scores


def test_cheaper_topk_masks_equal_the_general_one():
    """COVER's cheaper masks (issue #42) give the general `topk_mask`'s bits: `never_inf`
    (finite as `> -inf`), and `top1_or_at_least` (one `max(dim)` and a scatter) for the draft
    rule `topk_mask(s, 1) | (s >= threshold)`, over ties, empty rows and NaN."""
    from cover_vllm.strategies.sampling import top1_or_at_least, topk_mask

    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        ranked = _ranked_scores(gen)
        minus = torch.where(ranked.isneginf(), ranked, -ranked)    # -own, as COVER ranks it
        for scores in (ranked, minus, torch.empty(0, 12).double(), torch.empty(3, 0).double()):
            for k in (0, 1, 3, 12, torch.randint(-1, 6, (scores.shape[0],), generator=gen)):
                assert torch.equal(topk_mask(scores, k, never_inf=True), topk_mask(scores, k))
            for threshold in (0.0, 0.5, 0.9, 2.0):
                assert torch.equal(top1_or_at_least(scores, threshold),
                                   topk_mask(scores, 1) | (scores >= threshold))


def test_greedy_max_equals_greedy_and_amax():
    """`greedy_max` gives `greedy`'s indices and `amax`'s values; off the CPU it is one
    `max(dim)`, whose values and indices are checked here against the same pair (ties to the
    first index, a NaN row's NaN)."""
    from cover_vllm.strategies.sampling import greedy, greedy_max

    gen = torch.Generator().manual_seed(1)
    probs = torch.randint(0, 4, (7, 256), generator=gen).double().softmax(-1)     # ties
    probs[2, 5] = float("nan")
    best, conf = greedy_max(probs)
    values, indices = probs.max(dim=-1)
    for got in (best, indices):
        assert torch.equal(got, greedy(probs))
    for got in (conf, values):
        assert torch.allclose(got, probs.amax(-1), rtol=0, atol=0, equal_nan=True)

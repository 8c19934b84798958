"""The engine's threshold and fixed-step decisions reproduce Fast-dLLM's `get_transfer_index` on a
crafted near-tie (issue #48).

The official softmax runs over the whole vocabulary, [MASK] included; the engine holds [MASK] at
-inf in `StepBatch.logits` (so it is never proposed) and puts it back for confidences
(`StepBatch.mask_column`). Two masked rows whose float64 confidences differ by < 1e-10 make the
difference visible: with the [MASK] logit row 0 is the more confident, without it row 1. On a
random bf16 llada-50m such a tie flipped the position revealed at step 83 of 128 (103 of 128
tokens equal, 2026-11-29); the slow test below holds that case at 128 of 128.
"""

from __future__ import annotations

import math

import pytest
import torch

from cover_vllm.models.spec import ModelSpec
from cover_vllm.strategies import BlockState, StepBatch, decide_now, make_params, strategy_class
from cover_vllm.strategies.sampling import dense_rows
from official_order import OfficialLLaDA, Rule, _transfer, generate

V, MASK = 16, 15
SPEC = ModelSpec(family="llada", vocab_size=V, mask_token_id=MASK, eos_token_ids=(V - 2,),
                 pad_token_id=V - 2, logit_shift=0, max_model_len=128)


def _official_conf(logits: torch.Tensor) -> torch.Tensor:
    """[rows] float64 softmax probability of each row's argmax, [MASK] included (Fast-dLLM)."""
    p = torch.softmax(logits.to(torch.float64), dim=-1)
    return p.gather(-1, logits.argmax(-1, keepdim=True))[:, 0]


def _near_tie() -> torch.Tensor:
    """Logits [2, V] (float32): top logit 3 at token 0 in both rows, zeros elsewhere, [MASK] at -1
    (row 0) and 0 (row 1), a filler at token 1: x in row 0, y near -10 in row 1. Row 0 wins with
    [MASK] iff e^x + e^-1 < e^y + 1, and loses without it (x > y); x sits just below the bound
    and y is the float32 neighbour of -10 leaving the smallest positive margin."""
    bound = math.log(1 - math.exp(-1) + math.exp(-10))
    x = torch.nextafter(torch.tensor(bound), torch.tensor(-math.inf))
    neighbours = (torch.tensor([-10.0]).view(torch.int32)
                  + torch.arange(-20000, 20000, dtype=torch.int32)).view(torch.float32)
    rows = torch.zeros(neighbours.numel(), 2, V)
    rows[:, :, 0], rows[:, 0, MASK], rows[:, 1, MASK] = 3.0, -1.0, 0.0
    rows[:, 0, 1], rows[:, 1, 1] = x, neighbours
    conf = _official_conf(rows.view(-1, V)).view(-1, 2)
    margin = (conf[:, 0] - conf[:, 1]).masked_fill(conf[:, 0] <= conf[:, 1], math.inf)
    return rows[int(margin.argmin())]


def _batch(logits: torch.Tensor, with_mask_column: bool) -> StepBatch:
    """One request whose view is the two rows, both [MASK], the block = the view; the engine's
    logits hold [MASK] at -inf, `mask_logits` the column (or None: the engine before #48)."""
    engine = logits.clone()[None]
    engine[..., MASK] = float("-inf")
    state = BlockState(block_steps=2)
    ones = torch.ones(1, 2, dtype=torch.bool)
    return StepBatch(
        logits=engine, tokens=torch.full((1, 2), MASK), valid=ones, in_block=ones.clone(),
        is_gen=ones.clone(), states=[state], temperature=torch.zeros(1, dtype=torch.float64),
        top_p=torch.ones(1, dtype=torch.float64), top_k=torch.full((1,), -1),
        generators=[None], mask_id=MASK,
        mask_logits=logits[None, :, MASK].clone() if with_mask_column else None)


def _decide(name: str, params: dict, batch: StepBatch) -> list[int]:
    """The view positions the strategy reveals."""
    strategy = strategy_class(name)(make_params(name, params), SPEC)
    strategy.start_block(batch.states[0], 2)
    return decide_now(strategy, batch).commit[0].nonzero().flatten().tolist()


def test_the_crafted_logits_are_a_near_tie_the_mask_logit_decides():
    logits = _near_tie()
    with_mask = _official_conf(logits)
    without = _official_conf(torch.cat([logits[:, :MASK], logits[:, MASK + 1:]], dim=-1))
    assert 0 < float(with_mask[0] - with_mask[1]) < 1e-10
    assert float(without[1]) > float(without[0])


@pytest.mark.parametrize("name, params, rule", [
    ("threshold", {"threshold": 0.9}, Rule(0.9)),
    ("threshold", {"threshold": None}, Rule(None, 2)),         # Fast-dLLM's fixed steps
])
def test_the_engine_decides_as_the_official_rule_on_a_near_tie(name, params, rule):
    logits = _near_tie()
    official, _ = _transfer(logits, torch.full((2,), MASK), MASK, rule, count=1)
    assert official.tolist() == [0]
    assert _decide(name, params, _batch(logits, True)) == [0]
    with dense_rows():                                          # the device path, on the host
        assert _decide(name, params, _batch(logits, True)) == [0]
    assert _decide(name, params, _batch(logits, False)) == [1]  # [MASK] left out: the other one


@pytest.mark.slow
def test_bf16_llada_50m_no_cache_128_tokens_equal_the_official_order():
    """The case #48 found: a random llada-50m in bf16, threshold 0.9, blocks of 32, no cache;
    bitwise-equal logits up to step 83 of 128, where a 2.2e-11 near-tie went the other way."""
    from cover_vllm import LLM, SamplingParams
    from cover_vllm.models.builtin import resolve_model
    from cover_vllm.models.loader import load_model

    cfg = resolve_model("llada-50m").config
    mask_id = cfg["mask_token_id"]
    ref = OfficialLLaDA(load_model("llada-50m", "bfloat16", "dummy", 0), cfg)
    prompt = torch.randint(0, mask_id - 2, (16,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM("llada-50m", load_format="dummy", seed=0, dtype="bfloat16", kv_cache="none",
              num_threads=1)
    params = SamplingParams(max_tokens=128, block_length=32, ignore_eos=True,
                            decoding="threshold")
    result = llm.generate([prompt], params, use_tqdm=False)[0]
    want = generate(ref, prompt, 128, 32, mask_id, 0.9, "none")
    assert result.outputs[0].token_ids == want.ids[0, len(prompt):].tolist()
    assert result.metrics.nfe == len(want.steps)

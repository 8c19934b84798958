"""The `wino` strategy reproduces WINO's `decoding_wino` token for token, with its NFE.

Reference: Feng-Hong/WINO-DLLM LLaDA/decoding.py `decoding_wino` (golden decoder `wino_decoding`):
a shadow block of [MASK] query rows at the current block's positions, seen by no canvas row and
never cached, gives every revealed slot a leave-one-out score in the drafting forward.
"""

import pytest

from cover_vllm import LLM
from golden_cases import (GOLDEN, check_alone, check_batched, expected_tokens, load_cases,
                          real_prompts, sampling_params)

CASES = load_cases("llada", ("wino_decoding",))
IDS = [case["name"] for case in CASES]
MODEL = str(GOLDEN / "llada" / "model")


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, decoding="wino", kv_cache="none")


def test_every_wino_case_is_covered():
    assert len(CASES) >= 4
    assert {c["params"]["block_length"] for c in CASES} == {16, 32}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_one_at_a_time(llm, case):
    for out in check_alone(llm, case):
        m = out.metrics
        assert m.seeds_verified == m.keeps + m.remasks and m.flip_flops <= m.remasks


def test_cases_batched(llm):
    """Every case in one call: different prompts, block lengths and thresholds together."""
    outs = check_batched(llm, CASES)
    assert sum(o.metrics.remasks for o in outs) > 0          # Narrow-Out ran through Decision


def test_reference_attention_backend_agrees(case=CASES[0]):
    llm = LLM(MODEL, decoding="wino", kv_cache="none", attention_backend="reference")
    outs = llm.generate(real_prompts(case), sampling_params(case), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected_tokens(case)
    assert [o.metrics.nfe for o in outs] == [case["nfe"]]


@pytest.mark.parametrize("case", CASES[:1] + CASES[-1:], ids=IDS[:1] + IDS[-1:])
@pytest.mark.parametrize("kv_cache", ["prefix", "dual"])
def test_cache_modes(case, kv_cache):
    """Refreshed every step the cache modes are exact (shadow K/V never enter the cache); with
    the default block-start refresh they run and finish every block (approximate by design)."""
    exact = LLM(MODEL, decoding="wino", kv_cache=kv_cache, cache_refresh="interval:1")
    outs = exact.generate(real_prompts(case), sampling_params(case), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected_tokens(case)
    assert [o.metrics.nfe for o in outs] == [case["nfe"]]
    cached = LLM(MODEL, decoding="wino", kv_cache=kv_cache)
    (out,) = cached.generate(real_prompts(case), sampling_params(case), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == case["params"]["gen_length"]
    assert 299 not in out.outputs[0].token_ids

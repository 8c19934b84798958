"""LLaDA2.x and SDAR through the engine: every golden generate case token-, NFE- and
finish-reason-exact (LLaDA2.0 `generate`, LLaDA2.1 `generate`, SDAR `block_diffusion_generate`
and its argmax variant), alone, all cases of a family in one call, and with the cache off.
How each case maps to SamplingParams and to the engine's output: tests/golden_cases.py
(`block_sampling_params`, `expected_tokens`, `expected_nfe`)."""

import pytest

from cover_vllm import LLM
from golden_cases import (BLOCK_DECODERS, GOLDEN, check_alone, check_batched, load_cases,
                          without_early_stop)

FAMILIES = {"llada2": ("llada2_generate", "llada21_generate"),
            "sdar": ("sdar_block_diffusion_generate", "sdar_block_diffusion_generate_argmax")}
CASES = [(family, case) for family, decoders in FAMILIES.items()
         for case in load_cases(family, decoders)]
# the `_eos_` cases again with eos_early_stop off: same tokens, the reference's other call count
CASES += [(family, without_early_stop(case)) for family, case in CASES
          if "nfe_without_early_stop" in case]
IDS = [case["name"] for _, case in CASES]


@pytest.fixture(scope="module")
def engines():
    """The default cache (exact per-block KV reuse for block-causal models)."""
    return {family: LLM(str(GOLDEN / family / "model"), dtype="float32") for family in FAMILIES}


def test_every_case_is_mapped():
    counts = {family: sum(1 for fam, _ in CASES if fam == family) for family in FAMILIES}
    assert counts == {"llada2": 22 + 4, "sdar": 13}
    assert {case["decoder"] for _, case in CASES} == set(BLOCK_DECODERS)
    for _, case in CASES:
        ids = case["params"].get("eos_id", 298), case["params"]["mask_id"]
        assert ids == (298, 299), case["name"]        # the checkpoints' EOS and [MASK]


@pytest.mark.parametrize("family,case", CASES, ids=IDS)
def test_one_at_a_time(engines, family, case):
    check_alone(engines[family], case)


@pytest.mark.parametrize("family", FAMILIES)
def test_all_cases_in_one_call(engines, family):
    """Every case of a family in a single batch: decoders, knobs, prompt lengths mixed."""
    check_batched(engines[family], [case for fam, case in CASES if fam == family])


@pytest.mark.parametrize("family", FAMILIES)
def test_all_cases_without_kv_reuse(family):
    """kv_cache="none" recomputes every row each step: the same tokens and NFE."""
    llm = LLM(str(GOLDEN / family / "model"), dtype="float32", kv_cache="none")
    check_batched(llm, [case for fam, case in CASES if fam == family])

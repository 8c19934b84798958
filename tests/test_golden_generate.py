"""The engine reproduces the official reference decoders token for token, with their NFE:
LLaDA `generate` and Fast-dLLM `generate` (LLaDA), HF Dream `diffusion_generate` and Fast-dLLM's
Dream threshold decoding. (Saber and WINO have their own files.)"""

import pytest

from cover_vllm import LLM
from golden_cases import GOLDEN, check_alone, check_batched, load_cases

DECODERS = {"llada": ("llada_generate", "fastdllm_generate"),
            "dream": ("dream_diffusion_generate", "fastdllm_dream_threshold")}
CASES = [(family, case) for family, decoders in DECODERS.items()
         for case in load_cases(family, decoders)]
IDS = [case["name"] for _, case in CASES]


@pytest.fixture(scope="module")
def engines():
    return {family: LLM(str(GOLDEN / family / "model"), kv_cache="none") for family in DECODERS}


def test_every_family_has_cases():
    assert {family for family, _ in CASES} == set(DECODERS) and len(CASES) == 22


@pytest.mark.parametrize("family,case", CASES, ids=IDS)
def test_batched(engines, family, case):
    check_batched(engines[family], [case])


@pytest.mark.parametrize("family,case", CASES, ids=IDS)
def test_one_at_a_time(engines, family, case):
    check_alone(engines[family], case)


@pytest.mark.parametrize("family", DECODERS)
def test_all_cases_in_one_call(engines, family):
    """Every case of a family together in a single batch: strategies and shapes mixed."""
    check_batched(engines[family], [case for fam, case in CASES if fam == family])

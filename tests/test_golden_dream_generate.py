"""The engine reproduces Dream-v0 `diffusion_generate` and Fast-dLLM's Dream threshold decoding."""

import pytest

from cover_vllm import LLM
from golden_cases import GOLDEN, check_alone, check_batched, load_cases

CASES = load_cases("dream", ("dream_diffusion_generate", "fastdllm_dream_threshold"))


@pytest.fixture(scope="module")
def llm():
    return LLM(str(GOLDEN / "dream" / "model"), decoding="entropy", kv_cache="none")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_batched(llm, case):
    check_batched(llm, [case])


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_one_at_a_time(llm, case):
    check_alone(llm, case)


def test_all_cases_in_one_call(llm):
    """Every case's requests together in a single batch: strategies and shapes mixed."""
    check_batched(llm, CASES)

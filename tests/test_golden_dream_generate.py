"""The engine reproduces Dream-v0 `diffusion_generate` and Fast-dLLM's Dream threshold decoding."""

import pytest

from cover_vllm import LLM
from golden_cases import GOLDEN, expected_tokens, load_cases, real_prompts, sampling_params

CASES = load_cases("dream", ("dream_diffusion_generate", "fastdllm_dream_threshold"))


@pytest.fixture(scope="module")
def llm():
    return LLM(str(GOLDEN / "dream" / "model"), decoding="entropy", kv_cache="none")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_batched(llm, case):
    outs = llm.generate(real_prompts(case), sampling_params(case), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected_tokens(case)
    assert [o.metrics.nfe for o in outs] == [case["nfe"]] * len(outs)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_one_at_a_time(llm, case):
    for prompt, expect in zip(real_prompts(case), expected_tokens(case)):
        (out,) = llm.generate([prompt], sampling_params(case), use_tqdm=False)
        assert out.outputs[0].token_ids == expect
        assert out.metrics.nfe == case["nfe"]
        assert out.outputs[0].finish_reason == "length"


def test_all_cases_in_one_call(llm):
    """Every case's requests in a single batch: Dream algorithms, threshold and widths mixed."""
    prompts, params, expect = [], [], []
    for case in CASES:
        for prompt, tokens in zip(real_prompts(case), expected_tokens(case)):
            prompts.append(prompt)
            params.append(sampling_params(case))
            expect.append(tokens)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expect


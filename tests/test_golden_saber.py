"""The `saber` strategy reproduces Saber's LLaDA and Dream decoders token for token, with their NFE.

References: zhaoyMa/Saber decoding.py `generate_with_saber` (golden decoder `saber_generate`) and
Dream/generation_utils.py `diffusion_generate` (`saber_dream`); the rule set follows the model
(ModelSpec.saber_dream). NFE is the number of model calls (Saber-Dream reports one less).
"""

import pytest

from cover_vllm import LLM
from golden_cases import (GOLDEN, check_alone, check_batched, expected_tokens, load_cases,
                          real_prompts, sampling_params)

FAMILIES = {"llada": "saber_generate", "dream": "saber_dream"}
CASES = [(family, case) for family, decoder in FAMILIES.items()
         for case in load_cases(family, (decoder,))]
IDS = [case["name"] for _, case in CASES]


@pytest.fixture(scope="module")
def engines():
    return {family: LLM(str(GOLDEN / family / "model"), decoding="saber", kv_cache="none")
            for family in FAMILIES}


def test_every_saber_case_is_covered():
    assert len([c for c in CASES if c[0] == "llada"]) >= 4
    assert len([c for c in CASES if c[0] == "dream"]) >= 2


@pytest.mark.parametrize("family,case", CASES, ids=IDS)
def test_one_at_a_time(engines, family, case):
    for out in check_alone(engines[family], case):
        assert out.metrics.remasks > 0                       # backtracking goes through Decision
        assert out.metrics.flip_flops <= out.metrics.remasks


@pytest.mark.parametrize("family", FAMILIES)
def test_cases_batched(engines, family):
    """Every case of a family in one call: different prompts, block lengths and step counts."""
    check_batched(engines[family], [case for fam, case in CASES if fam == family])


@pytest.mark.parametrize("family,case", CASES[:1] + CASES[-1:], ids=IDS[:1] + IDS[-1:])
@pytest.mark.parametrize("kv_cache", ["prefix", "dual"])
def test_cache_modes_refreshing_every_step_are_exact(family, case, kv_cache):
    """The window covers saber's whole view: with a refresh every step the cache modes are exact."""
    llm = LLM(str(GOLDEN / family / "model"), decoding="saber", kv_cache=kv_cache,
              cache_refresh="interval:1")
    outs = llm.generate(real_prompts(case), sampling_params(case), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected_tokens(case)
    assert [o.metrics.nfe for o in outs] == [case["nfe"]] * len(outs)

"""The block decoders against the golden LLaDA2.x / SDAR cases without the engine: the official
block loop (tests/block_reference.py, no cache, the block-causal query x key mask) over the
model's own dense forward. Isolates the strategies from the engine: if this passes and
test_golden_block_generate.py fails, the engine's blocks, cache, stops or NFE differ."""

import pytest
import torch

from block_reference import run_requests
from cover_vllm.models.loader import load_model
from golden_cases import (GOLDEN, expected_finish, expected_nfe, expected_tokens, load_cases,
                          real_prompts, sampling_params, without_early_stop)

FAMILIES = {"llada2": ("llada2_generate", "llada21_generate"),
            "sdar": ("sdar_block_diffusion_generate", "sdar_block_diffusion_generate_argmax")}


def _cases(family: str) -> list[dict]:
    cases = load_cases(family, FAMILIES[family])
    return cases + [without_early_stop(c) for c in cases if "nfe_without_early_stop" in c]


@pytest.fixture(scope="module")
def models():
    return {family: load_model(GOLDEN / family / "model") for family in FAMILIES}


def _run(model, cases: list[dict]) -> None:
    def forward(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:   # [L], [L, L] bool
        with torch.no_grad():
            return model(ids[None], attention_mask=mask[None, None].long())[0]

    prompts = [real_prompts(c)[0]["prompt_token_ids"] for c in cases]
    reqs = run_requests(forward, model.spec, prompts, [sampling_params(c) for c in cases])
    for case, req in zip(cases, reqs):
        expect = expected_tokens(case)[0]
        got = (req.output(), req.nfe, req.finish_reason)
        assert got == (expect, expected_nfe(case), expected_finish(case, expect)), case["name"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_case_alone(models, family):
    for case in _cases(family):
        _run(models[family], [case])


@pytest.mark.parametrize("family", FAMILIES)
def test_all_cases_in_lockstep(models, family):
    """One batched `decide` per strategy instance each step, cases mixed."""
    _run(models[family], _cases(family))

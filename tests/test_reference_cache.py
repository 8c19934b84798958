"""The Fast-dLLM-style cache loops (reference_cache_decode.py) against the engine's prefix and
dual caches: the same tokens and the same number of forwards in fp32, at batch 1 and batched."""

import random

import pytest
import torch

from cover_vllm.llm import LLM
from cover_vllm.reference_cache_decode import DecodeSchedule, reference_cache_generate
from cover_vllm.reference_decode import reference_generate
from cover_vllm.sampling_params import SamplingParams

GEN, BLOCK = 32, 8


def _prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    spec = llm.engine.spec
    high = min(spec.eos_token_ids + (spec.mask_token_id,))
    rng = random.Random(1)
    return [[rng.randrange(high) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(llada_dir):
    return LLM(llada_dir, decoding="low_confidence", max_num_seqs=3, dtype="float32")


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cache_loop_matches_engine(llm, mode):
    model = llm.engine.executor.model
    schedule = DecodeSchedule(GEN, BLOCK, GEN, model.spec.mask_token_id)
    prompts = _prompts(llm, 3, 11)
    sp = SamplingParams(max_tokens=GEN, block_length=BLOCK, steps=GEN, ignore_eos=True,
                        kv_cache=mode, cache_refresh="block")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        tokens, nfe = reference_cache_generate(model, ids, schedule, mode)
        assert tokens == list(out.outputs[0].token_ids)
        assert nfe == out.metrics.nfe == GEN


def test_cache_loop_is_not_the_dense_loop(llm):
    """The cached K/V are stale between refreshes: the loops differ from the dense one somewhere
    (else the test above could not tell a cache from none), yet each is deterministic."""
    model = llm.engine.executor.model
    schedule = DecodeSchedule(GEN, BLOCK, GEN, model.spec.mask_token_id)
    prompts = _prompts(llm, 6, 11)
    dense = [reference_generate(model, p, GEN, BLOCK, GEN, schedule.mask_id) for p in prompts]
    dual = [reference_cache_generate(model, p, schedule, "dual")[0] for p in prompts]
    assert dual != dense
    assert dual == [reference_cache_generate(model, p, schedule, "dual")[0] for p in prompts]


def test_cache_loop_rejects_unknown_modes(llm):
    model = llm.engine.executor.model
    with pytest.raises(ValueError, match="prefix"):
        reference_cache_generate(model, [1], DecodeSchedule(GEN, BLOCK, GEN, 0), "none")
    with torch.no_grad(), pytest.raises(ValueError, match="multiple"):
        reference_cache_generate(model, [1], DecodeSchedule(GEN, 5, GEN, 0), "dual")

"""Nemotron-Labs-Diffusion under tensor parallelism: the engine's decoders inside its blocks
(with the causal commit) give TP=2 tokens and NFE equal to TP=1 in fp32; the three causal
decodings run in the driver process and say so for TP > 1."""

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from golden_cases import GOLDEN

DIR = str(GOLDEN / "nemotron" / "model_long")


@pytest.mark.slow   # worker processes
def test_tp2_equals_tp1_engine_decoders_and_refuses_causal_decodings():
    gen = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": [1] + torch.randint(12, 160, (int(n),), generator=gen)
                .tolist()} for n in (6, 13, 21)]
    single = LLM(DIR, dtype="float32", num_threads=1, kv_cache_memory_bytes=8 << 20)
    sharded = LLM(DIR, dtype="float32", num_threads=1, tensor_parallel_size=2,
                  kv_cache_memory_bytes=8 << 20)
    try:
        for name in ("cover", "low_confidence", "wino"):
            sp = SamplingParams(max_tokens=16, block_length=8, decoding=name, ignore_eos=True)
            want = single.generate(prompts, sp, use_tqdm=False)
            got = sharded.generate(prompts, sp, use_tqdm=False)
            assert [(o.outputs[0].token_ids, o.metrics.nfe) for o in got] == \
                [(o.outputs[0].token_ids, o.metrics.nfe) for o in want], name
        with pytest.raises(ValueError, match="tensor_parallel_size=1"):
            sharded.generate(prompts, SamplingParams(max_tokens=8, decoding="ar"),
                             use_tqdm=False)
    finally:
        sharded.shutdown()

"""Host work per engine step does not grow with the batch (issue #43): on the meta device
(shapes only, so every op with values is host work), LLaDA-8B's shape, the host ops of a step
at batch 64 stay within 3x those at batch 1 for every decoder the issue names."""

from __future__ import annotations

import pytest

from cover_vllm import LLM, SamplingParams
from cover_vllm.benchmarks.op_count import count_steps, summary

DECODERS = ["low_confidence", "threshold", "cover", "wino", "saber"]


@pytest.fixture(scope="module")
def meta_8b():
    return LLM("llada-8b", load_format="dummy", device="meta", num_threads=1,
               kv_cache_memory_bytes=4 << 30, max_num_seqs=64)


@pytest.mark.parametrize("decoding", DECODERS)
def test_host_ops_at_batch_64_are_within_3x_batch_1(meta_8b, decoding):
    params = SamplingParams(max_tokens=32, block_length=32, ignore_eos=True,
                            decoding=decoding, kv_cache="dual")
    one = summary(count_steps(meta_8b, params, 1))["host"]
    many = summary(count_steps(meta_8b, params, 64))["host"]
    assert many <= 3 * one, f"{decoding}: {many} host ops at batch 64, {one} at batch 1"

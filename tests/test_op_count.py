"""The op counter of cover_vllm/benchmarks/op_count.py: device ops, views and host ops are told
apart, and a meta engine step is counted per layer (issues #42, #43)."""

from __future__ import annotations

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.benchmarks.op_count import OpCounter, count_steps, summary


def test_the_counter_sorts_device_views_and_host_ops():
    with OpCounter() as ops:
        x = torch.zeros(4, 5, device="meta")        # device: zeros
        y = x.view(20)                               # device view
        (y + 1).sum()                                # device: add, sum
        torch.arange(3).tolist()                     # host: arange (tolist reads no op)
        torch.ones(1).item()                         # host: ones, _local_scalar_dense
    assert ops.num_device == 4 and ops.views == 1
    assert ops.host["arange"] == 1 and ops.host["ones"] == 1
    assert ops.num_host == 3


@pytest.fixture(scope="module")
def meta_llm():
    return LLM("llada-50m", load_format="dummy", device="meta", num_threads=1,
               kv_cache_memory_bytes=1 << 30, max_num_seqs=4)


def test_a_meta_step_is_counted_per_layer(meta_llm):
    params = SamplingParams(max_tokens=32, block_length=32, ignore_eos=True,
                            decoding="low_confidence")
    steps = count_steps(meta_llm, params, batch=2)
    s = summary(steps)
    assert steps and all(step.num_layers == meta_llm.engine.dims.num_layers for step in steps)
    assert s["device_per_layer"] >= 10 and s["host"] > 0     # a forward and its host work

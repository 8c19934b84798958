"""The `nemotron-diffusion-8b` shape on the meta device: an engine step of the decoders inside
its blocks (causal commit, YaRN, the Llama-4 q scale) stays within #42's bar of 32 device ops
per layer, as LLaDA-8B's does (tests/test_op_count.py), with the default official norm order
(issue #48; 2026-11-29, low_confidence / threshold: 30.5 / 29.9 at batch 1, 30.6 / 29.9 at
batch 64, from 32.1-34.1 with this norm; issue #50)."""

import pytest

from cover_vllm import LLM, SamplingParams
from cover_vllm.benchmarks.op_count import count_steps, summary

FLOOR_BAR = 32


@pytest.fixture(scope="module")
def meta_8b():
    return LLM("nemotron-diffusion-8b", load_format="dummy", device="meta", num_threads=1,
               kv_cache_memory_bytes=4 << 30, max_num_seqs=64)


@pytest.mark.parametrize("decoding", ["low_confidence", "threshold"])
@pytest.mark.parametrize("batch", [1, 64])
def test_device_ops_per_layer(meta_8b, decoding, batch):
    params = SamplingParams(max_tokens=32, block_length=32, ignore_eos=True, decoding=decoding)
    s = summary(count_steps(meta_8b, params, batch))
    print(f"nemotron-diffusion-8b {decoding} batch {batch}: "
          f"{s['device_per_layer']:.1f} device ops/layer")
    assert s["device_per_layer"] <= FLOOR_BAR

"""The `nemotron-diffusion-8b` shape on the meta device: an engine step of the decoders inside
its blocks (causal commit, YaRN, the Llama-4 q scale) stays within #42's bar of 32 device ops
per layer, as LLaDA-8B's does (tests/test_op_count.py): with the one-op RMSNorm (`fast_norm`), as
there; the default official norm order adds one op per norm (issue #48)."""

import pytest

from cover_vllm import LLM, SamplingParams
from cover_vllm.benchmarks.op_count import count_steps, summary

FLOOR_BAR = 32


@pytest.fixture(scope="module")
def meta_8b():
    return LLM("nemotron-diffusion-8b", load_format="dummy", device="meta", num_threads=1,
               kv_cache_memory_bytes=4 << 30, max_num_seqs=64, fast_norm=True)


@pytest.mark.parametrize("decoding", ["low_confidence", "threshold"])
@pytest.mark.parametrize("batch", [1, 64])
def test_device_ops_per_layer(meta_8b, decoding, batch, request):
    if (decoding, batch) == ("low_confidence", 64):     # open in issue #50: measured 32.09
        request.applymarker(pytest.mark.xfail(reason="3 ops a step over the bar since the #48 "
                                              "merges (32.09 per layer)", strict=True))
    params = SamplingParams(max_tokens=32, block_length=32, ignore_eos=True, decoding=decoding)
    s = summary(count_steps(meta_8b, params, batch))
    print(f"nemotron-diffusion-8b {decoding} batch {batch}: "
          f"{s['device_per_layer']:.1f} device ops/layer")
    assert s["device_per_layer"] <= FLOOR_BAR

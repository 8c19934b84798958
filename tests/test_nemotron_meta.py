"""The `nemotron-diffusion-8b` shape on the meta device (issue #50), with the default official
norm order (issue #48).

* The decoders inside its blocks (causal commit, YaRN, the Llama-4 q scale): an engine step
  stays within #42's bar of 32 device ops per layer, as LLaDA-8B's does (tests/test_op_count.py)
  (2026-11-29, low_confidence / threshold: 30.5 / 29.9 at batch 1, 30.6 / 29.9 at batch 64, from
  32.1-34.1 with this norm).
* Its own decodings (`nemotron`, `ar`, `linear_spec`; engine/nemotron_runner.py): a runner step
  stays within the same bar at batch 1 and 64, its host ops do not grow with the batch (at most
  3x batch 1's), and what it copies to the host is a few numbers per logits row, never a
  vocabulary-sized tensor (strategies/nemotron_decide.py).
"""

import pytest
import torch

from cover_vllm import LLM, SamplingParams
from cover_vllm.benchmarks.op_count import count_steps, steady, summary
from cover_vllm.layers.yarn import (ScaledQRotation, YarnParams, YarnRotaryEmbedding,
                                    positions_below)

FLOOR_BAR = 32
HOST_GROWTH_BAR = 3          # host ops of a batch-64 step / a batch-1 step
BLOCK = 32
OWN_DECODINGS = [("nemotron", {}), ("nemotron", {"threshold": 0.9}), ("ar", {}),
                 ("linear_spec", {}), ("linear_spec", {"threshold": 0.5})]


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


@pytest.fixture(scope="module")
def own_counts(meta_8b):
    """{(decoding, params, batch): every step's counts} of 32 tokens in blocks of 32."""
    counts = {}
    for decoding, knobs in OWN_DECODINGS:
        params = SamplingParams(max_tokens=32, block_length=BLOCK, ignore_eos=True,
                                decoding=decoding, decoding_params=knobs)
        for batch in (1, 64):
            counts[decoding, str(knobs), batch] = count_steps(meta_8b, params, batch)
    return counts


@pytest.mark.parametrize("decoding,knobs", OWN_DECODINGS)
def test_own_decodings_device_and_host_ops(own_counts, decoding, knobs):
    one, many = (summary(own_counts[decoding, str(knobs), b]) for b in (1, 64))
    print(f"nemotron-diffusion-8b {decoding} {knobs}: device ops/layer "
          f"{one['device_per_layer']:.2f} (batch 1) {many['device_per_layer']:.2f} (batch 64); "
          f"host ops {one['host']:.0f} / {many['host']:.0f}")
    assert one["device_per_layer_max"] <= FLOOR_BAR
    assert many["device_per_layer_max"] <= FLOOR_BAR
    assert many["host_max"] <= HOST_GROWTH_BAR * one["host"]


@pytest.mark.parametrize("decoding,knobs", OWN_DECODINGS)
def test_own_decodings_copy_no_vocabulary_row(own_counts, meta_8b, decoding, knobs):
    """Every step's copies to the host hold at most two numbers (a token id, a confidence) per
    logits row it asked for, and none is vocabulary-sized."""
    vocab = meta_8b.engine.dims.vocab_size
    for batch in (1, 64):
        steps = own_counts[decoding, str(knobs), batch]
        assert all(s.to_host for s in steady(steps)), "a step with no copy to the host"
        for s in steps:
            assert len(s.to_host) <= 1
            assert all(n <= 2 * batch * BLOCK < vocab for n in s.to_host)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_q_scale_skipped_below_original_max_changes_no_bit(dtype):
    """`positions_below` (layers/yarn.py): below original_max_position_embeddings the Llama-4
    scale is exactly 1, so the rotation without it gives the same bits; at or above it the
    scale is applied as before (issue #50)."""
    params = YarnParams(theta=1e6, factor=16.0, original_max=64, llama4_beta=0.1)
    rope = YarnRotaryEmbedding(16, params, q_fraction=4 / 6)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, 16, generator=gen).to(dtype)
    for positions, skipped in [(torch.arange(24, 64), True), (torch.arange(30, 70), False)]:
        want = rope.at(positions).rotate_(x.clone())                   # no bound: the scale
        with positions_below([rope], positions):
            rot = rope.at(positions)
            got = rot.rotate_(x.clone())
        assert (type(rot) is not ScaledQRotation) == skipped
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert rope.position_bound is None                  # reset after the forward

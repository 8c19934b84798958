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


def test_saber_memory_adds_no_host_ops_per_request(meta_8b):
    """Saber's per-slot confidences are rows of one table per instance (#48): a step reads and
    writes them with one gather and one scatter, so its host ops over low_confidence's (the
    engine's own per-request work) stay flat from batch 1 to 64.

    Measured (scripts/op_count.py, 2026-11-29): saber 319 / 347 / 491 host ops at batch
    1 / 16 / 64 (1.54x; 315 / 403 / 739 when the rows were Python objects), low_confidence
    282 / 313 / 457: Saber's share 37 at batch 1, 34 at batch 64. Bars: batch 64 <= 2x batch 1
    (measured 1.54x), and Saber's share at batch 64 within 8 ops of its share at batch 1."""
    def host(decoding: str, batch: int) -> float:
        params = SamplingParams(max_tokens=32, block_length=32, ignore_eos=True,
                                decoding=decoding, kv_cache="dual")
        return summary(count_steps(meta_8b, params, batch))["host"]

    one, many = host("saber", 1), host("saber", 64)
    assert many <= 2 * one, f"saber: {many} host ops at batch 64, {one} at batch 1"
    share_one, share_many = one - host("low_confidence", 1), many - host("low_confidence", 64)
    assert share_many <= share_one + 8, (
        f"saber's own host ops grew with the batch: {share_one} at batch 1, {share_many} at 64")

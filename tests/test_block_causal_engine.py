"""Block-causal models in the engine (LLaDA2.x, SDAR golden checkpoints): exact per-block KV
reuse against full recomputation, every decoder inside the current block, batching, prefix
caching and its /metrics hit rate."""

from __future__ import annotations

import httpx
import pytest

from cover_vllm import LLM, SamplingParams
from golden_cases import GOLDEN
FAMILIES = {"sdar": 4, "llada2": 8}                  # golden model -> block length used here
PROMPT_LENS = (5, 13, 16, 21)
DECODERS = ["low_confidence", "threshold", "cover", "wino", "saber", "asrd"]


def _prompts(lengths=PROMPT_LENS, offset=3):
    return [{"prompt_token_ids": [(offset + 7 * i + j * 13) % 290 for j in range(n)]}
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def engines(family):
    """(per-block reuse engine, full-recompute engine) over one golden checkpoint."""
    model = str(GOLDEN / family / "model")
    make = lambda kv: LLM(model=model, dtype="float32", kv_cache=kv,  # noqa: E731
                          enable_prefix_caching=False, max_num_seqs=16)
    return make("dual"), make("none")


def _run(llm, family, decoding, prompts=None, max_tokens=20, **kw):
    params = SamplingParams(max_tokens=max_tokens, block_length=FAMILIES[family], temperature=0,
                            decoding=decoding, ignore_eos=True, **kw)
    return llm.generate(prompts or _prompts(), params, use_tqdm=False)


@pytest.mark.parametrize("decoding", DECODERS)
def test_per_block_reuse_equals_full_recompute(engines, family, decoding):
    cached, full = engines
    a, b = _run(cached, family, decoding), _run(full, family, decoding)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.metrics.nfe == y.metrics.nfe
        assert x.metrics.forward_tokens < y.metrics.forward_tokens
        assert len(x.outputs[0].token_ids) == 20


def test_rows_against_the_official_recompute(engines, family):
    """Per-block reuse runs each block once plus its commit: a request spanning >= 4 blocks
    computes at most half the rows the official LLaDA2 `generate` recomputes (the whole prefix
    x[:, :(k+1)B] on every call)."""
    cached, _ = engines
    block = FAMILIES[family]
    for prompt, out in zip(_prompts(), _run(cached, family, "low_confidence", max_tokens=40)):
        p = len(prompt["prompt_token_ids"])
        first, last = p // block, -(-(p + 40) // block)
        assert last - first >= 4
        steps_per_block = out.metrics.nfe // (last - first)      # low_confidence: fixed steps
        official = sum(steps_per_block * (k + 1) * block for k in range(first, last))
        assert out.metrics.forward_tokens <= official / 2, (out.metrics.forward_tokens, official)


def test_mixed_decoders_in_one_batch_equal_each_alone(engines, family):
    cached, _ = engines
    prompts = _prompts((5, 13, 16, 21, 9, 30))
    alone = [_run(cached, family, d, [p])[0].outputs[0].token_ids
             for d, p in zip(DECODERS, prompts)]
    params = [SamplingParams(max_tokens=20, block_length=FAMILIES[family], temperature=0,
                             decoding=d, ignore_eos=True) for d in DECODERS]
    mixed = cached.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == alone


def test_prefix_caching_reuses_full_prompt_blocks_exactly(family):
    """A second request sharing three full prompt blocks computes none of their rows and gives
    exactly the tokens it gives with caching off."""
    model, block = str(GOLDEN / family / "model"), FAMILIES[family]
    shared = [(11 * j + 5) % 290 for j in range(3 * block)]
    first = {"prompt_token_ids": shared + [7, 8]}
    second = {"prompt_token_ids": shared + [9, 10, 11]}
    params = SamplingParams(max_tokens=12, block_length=block, temperature=0, ignore_eos=True,
                            decoding="low_confidence")
    on = LLM(model=model, dtype="float32", page_size=block)
    off = LLM(model=model, dtype="float32", page_size=block, enable_prefix_caching=False)
    on.generate([first], params, use_tqdm=False)
    hit = on.generate([second], params, use_tqdm=False)[0]
    ref = off.generate([second], params, use_tqdm=False)[0]
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids
    assert hit.metrics.cached_prompt_tokens == 3 * block
    assert hit.metrics.forward_tokens == ref.metrics.forward_tokens - 3 * block


def test_reset_prefix_cache_forgets_every_block():
    """`LLM.reset_prefix_cache()` (as vLLM's): the next request computes its prompt blocks again,
    with the same tokens, and every page is free once nothing runs."""
    block = FAMILIES["sdar"]
    llm = LLM(model=str(GOLDEN / "sdar" / "model"), dtype="float32", page_size=block)
    prompt = {"prompt_token_ids": [(11 * j + 5) % 290 for j in range(3 * block + 1)]}
    params = SamplingParams(max_tokens=8, block_length=block, temperature=0, ignore_eos=True,
                            decoding="low_confidence")
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.generate([prompt], params, use_tqdm=False)[0].metrics.cached_prompt_tokens \
        == 3 * block
    llm.reset_prefix_cache()
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.metrics.cached_prompt_tokens == 0
    assert again.metrics.forward_tokens == first.metrics.forward_tokens
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.reset_prefix_cache()
    pool = llm.engine.pool
    assert pool.num_free == pool.num_pages and not pool.lookup([b"any"])


def test_prefix_caching_is_refused_for_full_attention():
    with pytest.raises(ValueError, match="block-causal"):
        LLM(model=str(GOLDEN / "llada" / "model"), dtype="float32", enable_prefix_caching=True)


def test_prefix_cache_hit_rate_in_metrics():
    pytest.importorskip("fastapi")
    from serve_helpers import start_server

    block = FAMILIES["sdar"]
    srv = start_server(str(GOLDEN / "sdar" / "model"), page_size=block, dtype="float32")
    try:
        ids = [(5 * j + 1) % 290 for j in range(4 * block)]
        for tail in ([3], [4]):
            resp = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": "test-model", "prompt": ids + tail, "max_tokens": 8, "temperature": 0,
                "block_length": block, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
        text = httpx.get(srv.url + "/metrics").text
        rate = next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("cover_vllm_prefix_cache_hit_rate"))
        assert rate == pytest.approx(0.5)        # the second of two equal 4-block prefixes
    finally:
        srv.stop()

"""What the server refuses is refused offline too, at construction and naming the field: NaN /
inf sampling numbers, decoding_params that are no knobs, a KV budget with no page, a prompt or
sampling params of the wrong kind (issue #52)."""

from __future__ import annotations

import logging

import pytest

from cover_vllm import LLM, SamplingParams


@pytest.mark.parametrize("name", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_sampling_numbers_must_be_finite(name, value) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{name} must be a finite number"):
        SamplingParams(**{name: value})


def test_decoding_params_are_checked_at_construction() -> None:
    with pytest.raises(TypeError, match="decoding_params must be a dict"):
        SamplingParams(decoding_params="x")
    with pytest.raises(ValueError, match="decoding_params must be a dict"):
        SamplingParams(decoding_params="x")
    with pytest.raises(TypeError, match="decoding_params must be a dict"):
        SamplingParams(decoding_params={1: 0.9})
    with pytest.raises(ValueError, match=r"decoding_params \['treshold'\]: no decoder has"):
        SamplingParams(decoding_params={"treshold": 0.9})
    assert SamplingParams(decoding_params={"threshold": 0.9}).decoding_params == {
        "threshold": 0.9}


def test_a_kv_budget_with_no_page_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=10 holds no KV page: one page "
                                         r"of 16 tokens takes \d+ bytes, and a request of "
                                         r"max_model_len \(\d+ tokens\) needs \d+"):
        LLM("cover-tiny", kv_cache_memory_bytes=10)


def test_a_kv_budget_below_one_long_request_is_logged(caplog) -> None:
    page = LLM("cover-tiny", num_threads=1).engine.memory.kv_bytes_per_token * 16
    with caplog.at_level(logging.WARNING):
        llm = LLM("cover-tiny", num_threads=1, kv_cache_memory_bytes=2 * page)
    assert llm.engine.pool.num_pages == 2
    assert any("holds 2 pages = 32 tokens, less than one request of max_model_len"
               in r.getMessage() for r in caplog.records)


@pytest.fixture(scope="module")
def llm():
    return LLM("cover-tiny", num_threads=1)


@pytest.mark.parametrize("prompts", [5, 2.5, None, b"hello"])
def test_prompts_of_the_wrong_kind_name_prompts(llm, prompts) -> None:
    with pytest.raises(ValueError, match="prompts must be a string, a list of token ids"):
        llm.generate(prompts, use_tqdm=False)


@pytest.mark.parametrize("params", [{"max_tokens": 8}, [{"max_tokens": 8}], 3])
def test_sampling_params_of_the_wrong_kind_name_sampling_params(llm, params) -> None:
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm.generate("hello", params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_prompts_and_params_may_be_any_iterable(llm) -> None:
    outs = llm.generate((p for p in ["12+34=", "5+6="]),
                        (SamplingParams(max_tokens=4) for _ in range(2)), use_tqdm=False)
    assert len(outs) == 2

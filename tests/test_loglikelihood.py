"""LLM.loglikelihood: the official LLaDA estimator's golden values (alone and all in one call),
its expectation, the slow reference loop on every family (Dream's shift, the block-causal
families' shared context blocks), batching invariance, mixing with generation, and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cover_vllm import LLM, LoglikelihoodParams, SamplingParams
from cover_vllm.models.base import dense_forward
from cover_vllm.models.loader import load_model
from cover_vllm.scoring.reference import (block_causal_logits, reference_is_greedy,
                                          reference_loglikelihood)
from golden_cases import GOLDEN

CASES = json.loads((GOLDEN / "llada" / "loglikelihood.json").read_text())


def _tol(value: float) -> float:
    """The golden README's tolerance: max(1e-4, 1e-5 * |logprob|)."""
    return max(1e-4, 1e-5 * abs(value))


def _request(case: dict) -> dict:
    return {"context_token_ids": case["context_ids"],
            "continuation_token_ids": case["continuation_ids"]}


def _params(case: dict, seed: int | None = None) -> LoglikelihoodParams:
    return LoglikelihoodParams(mc_num=case["mc_num"], batch_size=case["batch_size"],
                               seed=case["seed"] if seed is None else seed,
                               cfg_scale=case["cfg_scale"], check_greedy=True)


@pytest.fixture(scope="module")
def llada(llada_dir):
    llm = LLM(llada_dir, dtype="float32", kv_cache_memory_bytes=64 << 20)
    yield llm
    llm.shutdown()


def test_golden_all_in_one_call(llada):
    outs = llada.loglikelihood([_request(c) for c in CASES], [_params(c) for c in CASES],
                               use_tqdm=False)
    for case, out in zip(CASES, outs):
        assert abs(out.logprob - case["logprob"]) <= _tol(case["logprob"]), case["name"]
        assert out.is_greedy == case["is_greedy"], case["name"]
        assert math.isclose(sum(out.token_logprobs), out.logprob, abs_tol=1e-6)
        assert out.metrics.sample_rows == case["mc_num"]
    assert llada.engine.pool.num_used == 0           # every page is back


def test_golden_alone(llada):
    for case in CASES:
        out = llada.loglikelihood(_request(case), _params(case), use_tqdm=False)[0]
        assert abs(out.logprob - case["logprob"]) <= _tol(case["logprob"]), case["name"]
        assert out.is_greedy == case["is_greedy"], case["name"]


def test_expectation_within_four_standard_errors(llada):
    """The mean over 20 other seeds lies within 4 standard errors (mc_std / sqrt 20) of the
    exact expected value, for every case that has one."""
    cases = [c for c in CASES if "exact_expectation" in c and c["mc_std"] > 0]
    reqs = [_request(c) for c in cases for _ in range(20)]
    params = [LoglikelihoodParams(mc_num=c["mc_num"], batch_size=c["batch_size"],
                                  seed=c["seed"] + 1000 + i, cfg_scale=c["cfg_scale"])
              for c in cases for i in range(20)]
    outs = llada.loglikelihood(reqs, params, use_tqdm=False)
    for n, case in enumerate(cases):
        mean = sum(o.logprob for o in outs[20 * n:20 * n + 20]) / 20
        se = case["mc_std"] / math.sqrt(20)
        assert abs(mean - case["exact_expectation"]) <= 4 * se, case["name"]


def test_batch_never_changes_a_value(llada, llada_dir):
    """A seeded request gives the same value alone, beside others, beside generation, and with
    fewer sequences per forward (max_num_seqs 3 splits its copies over several forwards)."""
    case = CASES[4]                                       # mc 128, b 32, T 8
    alone = llada.loglikelihood(_request(case), _params(case), use_tqdm=False)[0].logprob
    engine = llada.engine
    engine.add_request("gen", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(max_tokens=8, seed=0, decoding="low_confidence"))
    engine.add_request("score", _request(case), _params(case))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["score"].logprob == pytest.approx(alone, abs=1e-5)   # same draws; fp32 sums
    assert len(done["gen"].outputs[0].token_ids) == 8
    small = LLM(llada_dir, dtype="float32", max_num_seqs=3,
                kv_cache_memory_bytes=8 << 20)
    out = small.loglikelihood(_request(case), _params(case), use_tqdm=False)[0]
    assert out.logprob == pytest.approx(alone, abs=2e-5)
    assert out.metrics.nfe > 8                            # 128 copies, 3 sequences a forward


def _official(model, case_like: dict, params: LoglikelihoodParams, shift: int = 0,
              block: int | None = None):
    if block is None:
        def logits_fn(batch):
            n = batch.shape[1]
            return dense_forward(model, batch, torch.arange(n).expand(batch.shape[0], n), None)
    else:
        logits_fn = block_causal_logits(model, block)
    ctx, cont = case_like["context_token_ids"], case_like["continuation_token_ids"]
    mask = model.spec.mask_token_id
    return (reference_loglikelihood(logits_fn, ctx, cont, params, mask, shift),
            reference_is_greedy(logits_fn, ctx, cont, params, mask, shift))


@pytest.mark.parametrize("family", ["dream", "llada2", "sdar"])
def test_families_match_the_reference_loop(family):
    """Dream (its logit shift; an empty context reads position 0 from row 0), LLaDA2 and SDAR
    (block-causal: the context's full blocks computed once and shared by every copy) against
    the official loop run on the same model, with and without cfg."""
    path = str(GOLDEN / family / "model")
    model = load_model(path, "float32")
    spec = model.spec
    block = spec.attention.block_size if spec.attention.is_block_causal else None
    gen = torch.Generator().manual_seed(3)
    reqs = []
    b = block or 6
    for p, t in ((0, 3), (5, 4), (2 * b + 1, 6), (b + 3, 2)):
        ids = torch.randint(0, spec.mask_token_id - 2, (p + t,), generator=gen).tolist()
        reqs.append({"context_token_ids": ids[:p], "continuation_token_ids": ids[p:]})
    params = [LoglikelihoodParams(mc_num=8, batch_size=4, seed=i, check_greedy=True,
                                  cfg_scale=1.0 if i == 2 else 0.0) for i in range(len(reqs))]
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=16 << 20)
    outs = llm.loglikelihood(reqs, params, use_tqdm=False)
    for req, p, out in zip(reqs, params, outs):
        value, greedy = _official(model, req, p, spec.logit_shift, block)
        assert abs(out.logprob - value) <= _tol(value), (family, req)
        assert out.is_greedy == greedy
    if block is not None:                 # P = 2B + 1 (cfg): 2 full blocks, computed once per
        out = outs[2]                     # variant (cond, uncond) and read by every copy
        assert out.metrics.shared_context_tokens == 2 * (2 * block)
        run = 2 * block + 1 + 6 - 2 * block
        assert out.metrics.forward_tokens == 2 * (2 * block + 8 * run + run)
    assert llm.engine.pool.num_used == 0       # cached prefix pages count as free
    llm.shutdown()


def test_block_causal_context_shared_across_requests():
    """Four continuations of one context (a multiple-choice question) on SDAR: the context's
    full blocks are written once, in the first forward, and read by all four."""
    path = str(GOLDEN / "sdar" / "model")
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=16 << 20)
    ctx = list(range(10, 30))
    reqs = [{"context_token_ids": ctx, "continuation_token_ids": [40 + i, 50, 60]}
            for i in range(4)]
    params = LoglikelihoodParams(mc_num=8, batch_size=8, seed=0)
    together = llm.loglikelihood(reqs, params, use_tqdm=False)
    block = llm.engine.spec.attention.block_size
    shared = 20 // block * block
    run = 20 + 3 - shared
    first = together[0].metrics.forward_tokens
    assert first == shared + 8 * run              # the writer: the prefix once, then its copies
    assert all(o.metrics.forward_tokens == 8 * run for o in together[1:])
    alone = [llm.loglikelihood(r, params, use_tqdm=False)[0] for r in reqs]
    for a, b in zip(together, alone):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert alone[0].metrics.cached_context_tokens > 0   # from the prefix cache now
    llm.shutdown()


def test_one_token_continuation_is_exact_and_has_top_logprobs(llada):
    out = llada.loglikelihood({"context_token_ids": [3, 4, 5], "continuation_token_ids": [9]},
                              LoglikelihoodParams(mc_num=4, batch_size=2, logprobs=3),
                              use_tqdm=False)[0]
    top = out.top_logprobs[0]
    assert len(top) == 3 and max(top.values()) >= out.logprob
    again = llada.loglikelihood({"context_token_ids": [3, 4, 5],
                                 "continuation_token_ids": [9]},
                                LoglikelihoodParams(mc_num=32, batch_size=8, seed=7),
                                use_tqdm=False)[0]
    assert again.logprob == pytest.approx(out.logprob, abs=1e-6)   # no sampling at T = 1


@pytest.mark.parametrize("kwargs, match", [
    ({"mc_num": 10, "batch_size": 4}, "mc_num .* multiple of batch_size"),
    ({"mc_num": 0}, "mc_num"),
    ({"batch_size": True}, "batch_size"),
    ({"cfg_scale": -1.0}, "cfg_scale"),
    ({"logprobs": 21}, "logprobs"),
])
def test_bad_params(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LoglikelihoodParams(**kwargs)


@pytest.mark.parametrize("request_, match", [
    ({"context_token_ids": [1], "continuation_token_ids": []}, "continuation_token_ids is empty"),
    ({"context_token_ids": [1]}, "continuation_token_ids"),
    ({"context_token_ids": [1], "continuation_token_ids": [999]}, "continuation_token_ids"),
    ({"context_token_ids": [1] * 5000, "continuation_token_ids": [2]}, "max_model_len"),
    (("some text", "more"), "no tokenizer"),
    (42, "scoring request"),
])
def test_bad_requests_name_the_field(llada, request_, match):
    with pytest.raises((ValueError, TypeError), match=match):
        llada.loglikelihood([{"context_token_ids": [1], "continuation_token_ids": [2]},
                             request_], LoglikelihoodParams(mc_num=2, batch_size=2))
    assert not llada.engine.has_unfinished_requests()     # the good one was not left queued


def test_logprobs_needs_one_token(llada):
    with pytest.raises(ValueError, match="one-token continuation"):
        llada.loglikelihood({"context_token_ids": [1], "continuation_token_ids": [2, 3]},
                            LoglikelihoodParams(mc_num=2, batch_size=2, logprobs=1))


def test_bench_loglikelihood_command(tmp_path, capsys):
    """`cover-vllm bench loglikelihood` at toy sizes: both tables and the JSON report."""
    from cover_vllm.entrypoints.cli import main

    out = tmp_path / "ll.json"
    assert main(["bench", "loglikelihood", "--mc-num", "8", "--batch-size", "8",
                 "--questions", "2", "--reference-requests", "2", "--rate-problems", "3",
                 "--block-model", str(GOLDEN / "sdar" / "model"), "--block-context", "16",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "official req/s" in table and "6-way rate at mc_num 8" in table
    report = json.loads(out.read_text())
    shared, unshared = report["block_causal"][1], report["block_causal"][0]
    assert shared["rows_per_request"] < unshared["rows_per_request"] \
        < unshared["official_rows_per_request"]

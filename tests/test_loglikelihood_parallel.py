"""Likelihood scoring under tensor parallelism: a sharded forward's scoring totals equal the
unsharded ones (two ranks as threads, default suite), and whole TP=2 engines reproduce the golden
values (worker processes, slow)."""

from __future__ import annotations

import json

import pytest
import torch

from cover_vllm import LLM, LoglikelihoodParams
from cover_vllm.scheduler.output import SchedulerOutput
from cover_vllm.scheduler.page_pool import PagePool
from cover_vllm.scheduler.score_queue import ScoreQueue
from cover_vllm.scheduler.score_request import scoring_request
from golden_cases import GOLDEN
from test_tensor_parallel import _in_threads, _model_dir, thread_ranks

CASES = json.loads((GOLDEN / "llada" / "loglikelihood.json").read_text())


def _score_step(family: str, config, spec, num_pages: int) -> SchedulerOutput:
    """One scoring step of three requests (one with cfg, one with the greedy check)."""
    queue = ScoreQueue(config, PagePool(num_pages), prefix_caching=True)
    gen = torch.Generator().manual_seed(0)
    for i, (p, t) in enumerate(((6, 3), (13, 5), (0, 2))):
        ids = torch.randint(0, spec.mask_token_id - 2, (p + t,), generator=gen).tolist()
        params = LoglikelihoodParams(mc_num=8, batch_size=4, seed=i, check_greedy=i == 1,
                                     cfg_scale=1.0 if i == 0 else 0.0)
        queue.add(scoring_request(spec, None, f"s{i}", {"context_token_ids": ids[:p],
                                                       "continuation_token_ids": ids[p:]},
                                  params, seed=i))
    queue.admit(0)
    return SchedulerOutput([], score_items=queue.schedule())


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_sharded_scoring_matches_unsharded_in_threads(family):
    with thread_ranks(family) as (config, spec, full, ranks):
        out = _score_step(family, config, spec, full.num_pages)
        want = full.execute_model(out).scores
        got = _in_threads(lambda r: ranks[r].execute_model(out), 2)
        assert len(want) == 3
        for g, w in zip(got[0].scores, want):
            assert torch.allclose(g.token_loss, w.token_loss, rtol=1e-5, atol=1e-4)
            assert g.greedy == w.greedy


@pytest.mark.slow   # worker processes
def test_tp2_engine_reproduces_the_golden_values():
    llm = LLM(_model_dir("llada"), tensor_parallel_size=2, num_threads=1, dtype="float32")
    try:
        reqs = [{"context_token_ids": c["context_ids"],
                 "continuation_token_ids": c["continuation_ids"]} for c in CASES]
        params = [LoglikelihoodParams(mc_num=c["mc_num"], batch_size=c["batch_size"],
                                      seed=c["seed"], cfg_scale=c["cfg_scale"],
                                      check_greedy=True) for c in CASES]
        for case, out in zip(CASES, llm.loglikelihood(reqs, params, use_tqdm=False)):
            assert abs(out.logprob - case["logprob"]) <= max(1e-4, 1e-5 * abs(case["logprob"]))
            assert out.is_greedy == case["is_greedy"]
    finally:
        llm.shutdown()

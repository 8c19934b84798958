"""Likelihood scoring with data parallelism: `cover-vllm serve --data-parallel-size 2` (two
engine replicas as Ray actors) spreads echo + logprobs scoring requests over both replicas and
every value equals offline LLM.loglikelihood with the same seed."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serve_helpers import write_tiny_model  # noqa: E402
from test_server_dp import _replica_counts, _server  # noqa: E402

from cover_vllm import LLM, LoglikelihoodParams  # noqa: E402

PAIRS = [([5 + i, 6, 7, 8], [9, 10 + i, 11]) for i in range(8)]


@pytest.mark.slow   # Ray actors
@pytest.mark.ray
def test_dp2_scoring_matches_offline(tmp_path, ray_session):
    model = write_tiny_model(tmp_path / "tiny-llada")
    with LLM(model, num_threads=1) as llm:
        want = llm.loglikelihood(
            [{"context_token_ids": c, "continuation_token_ids": y} for c, y in PAIRS],
            [LoglikelihoodParams(mc_num=16, batch_size=4, seed=i) for i in range(len(PAIRS))],
            use_tqdm=False)
    srv = _server(model, "--data-parallel-size", "2")
    try:
        def score(i: int) -> float:
            ctx, cont = PAIRS[i]
            resp = httpx.post(srv.url + "/v1/completions", timeout=120, json={
                "model": "test-model", "prompt": ctx, "continuation": cont, "echo": True,
                "max_tokens": 0, "logprobs": 0, "mc_num": 16, "mc_batch_size": 4, "seed": i})
            assert resp.status_code == 200, resp.text
            return sum(resp.json()["choices"][0]["logprobs"]["token_logprobs"][len(ctx):])

        before = _replica_counts(srv)
        with cf.ThreadPoolExecutor(len(PAIRS)) as pool:
            got = list(pool.map(score, range(len(PAIRS))))
        after = _replica_counts(srv)
    finally:
        srv.stop()
    assert got == pytest.approx([o.logprob for o in want], abs=1e-4)
    served = {r: after[r] - before.get(r, 0.0) for r in after}
    assert all(v > 0 for v in served.values()) and len(served) == 2, served

"""Likelihood scoring through the server: `/v1/completions` with echo + logprobs (+ max_tokens 0)
against LLM.loglikelihood, the chain-rule values lm-eval's local-completions reads, scoring and
generating at once, and 400s naming the field."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi")

from serve_helpers import start_server  # noqa: E402

from cover_vllm import LLM, LoglikelihoodParams  # noqa: E402

CONTEXT, CONTINUATION = "384+250=", "0+4+0=04"


@pytest.fixture(scope="module")
def server():
    srv = start_server("cover-tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm():
    return LLM("cover-tiny")


def _post(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions",
                      json={"model": "test-model", "echo": True, "logprobs": 1, **body},
                      timeout=120)


def test_continuation_values_sum_to_the_offline_estimate(server, llm) -> None:
    resp = _post(server, prompt=CONTEXT, continuation=CONTINUATION, max_tokens=0, seed=3,
                 mc_num=32, mc_batch_size=8)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == CONTEXT + CONTINUATION
    offline = llm.loglikelihood((CONTEXT, CONTINUATION),
                                LoglikelihoodParams(mc_num=32, batch_size=8, seed=3),
                                use_tqdm=False)[0]
    num_ctx = len(offline.context_token_ids)
    assert lp["token_logprobs"][:num_ctx] == [None] * num_ctx
    assert sum(lp["token_logprobs"][num_ctx:]) == pytest.approx(offline.logprob, abs=1e-6)
    assert choice["loglikelihood"]["logprob"] == pytest.approx(offline.logprob, abs=1e-9)
    ids = llm.get_tokenizer().encode(CONTEXT, add_special_tokens=False)
    cont = offline.continuation_token_ids
    by_ids = _post(server, prompt=ids, continuation=cont, max_tokens=0, seed=3, mc_num=32,
                   mc_batch_size=8).json()["choices"][0]
    assert by_ids["loglikelihood"]["logprob"] == pytest.approx(offline.logprob, abs=1e-9)


def test_echo_without_continuation_gives_chain_rule_values(server, llm) -> None:
    """lm-eval's local-completions request: echo, logprobs 1, max_tokens 1; it sums
    token_logprobs[ctxlen:-1]. Token i's value is the exact one-token estimate given x_<i."""
    prompt = CONTEXT + "0+4"
    resp = _post(server, prompt=prompt, max_tokens=1)
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    want = llm.loglikelihood([{"context_token_ids": ids[:i], "continuation_token_ids": [ids[i]]}
                              for i in range(1, len(ids))],
                             LoglikelihoodParams(mc_num=1, batch_size=1), use_tqdm=False)
    for value, top, out in zip(lp["token_logprobs"][1:-1], lp["top_logprobs"][1:-1], want):
        assert value == pytest.approx(out.logprob, abs=1e-4)   # other batch: fp32 sums
        assert max(top.values()) >= value - 1e-9 and len(top) in (1, 2)


def test_scores_and_generates_at_once(server) -> None:
    async def both():
        async with httpx.AsyncClient(timeout=120) as client:
            gen = client.post(server.url + "/v1/completions",
                              json={"prompt": CONTEXT, "max_tokens": 16})
            score = client.post(server.url + "/v1/completions",
                                json={"prompt": CONTEXT, "continuation": CONTINUATION,
                                      "echo": True, "max_tokens": 0, "logprobs": 0,
                                      "mc_num": 8, "mc_batch_size": 8, "seed": 1})
            return await asyncio.gather(gen, score)

    gen, score = asyncio.run(both())
    assert gen.status_code == 200 and gen.json()["choices"][0]["text"]
    assert score.status_code == 200 and score.json()["choices"][0]["loglikelihood"]["logprob"] < 0


@pytest.mark.parametrize("body, param, words", [
    ({"continuation": ""}, "continuation", "continuation is empty"),
    ({"continuation": "1" * 600}, "continuation", "maximum context length"),
    ({"continuation": "5", "mc_num": 10, "mc_batch_size": 4}, "mc_num", "multiple"),
    ({"continuation": "5", "echo": False}, "continuation", "needs echo=true"),
    ({"mc_num": 8, "logprobs": None}, "mc_num", "needs echo=true"),
    ({"echo": False}, "max_tokens", "needs echo=true"),
    ({"continuation": "5", "max_tokens": 4}, "continuation", "max_tokens to 0"),
    ({"continuation": "5", "stream": True}, "stream", "stream"),
    ({"continuation": "5", "n": 2}, "n", "n=1"),
])
def test_bad_scoring_requests_are_400s_naming_the_field(server, body, param, words) -> None:
    resp = _post(server, **{"prompt": CONTEXT, "max_tokens": 0, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error

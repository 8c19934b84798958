"""`n`, logprobs (completions and chat forms), stop_reason and token ids through the OpenAI
server with the official `openai` client, streamed and not, against offline LLM.generate; and a
model without a tokenizer answering with token ids."""

from __future__ import annotations

import json
import logging
import shutil

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_helpers import start_server  # noqa: E402

from cover_vllm import LLM, SamplingParams  # noqa: E402
from cover_vllm.models.builtin import BUILTIN_DIRS  # noqa: E402

PROMPT = "what is 1 + 2 ?"
NOISY = {"block_length": 8, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "what is 9 + 9 ?"}]


@pytest.fixture(scope="module")
def server():
    srv = start_server("cover-tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm():
    return LLM("cover-tiny", decoding="low_confidence")


def _complete(client, **kwargs):
    body = {"model": "test-model", "prompt": PROMPT, "max_tokens": 16, **kwargs}
    extra = {k: body.pop(k) for k in list(body) if k in ("block_length", "ignore_eos",
                                                         "return_token_ids", "decoding")}
    return client.completions.create(**body, extra_body=extra)


def test_n_returns_n_choices_per_prompt_as_offline(client, llm) -> None:
    resp = _complete(client, prompt=[PROMPT, "hello"], n=3, temperature=2.0, seed=9, **NOISY)
    assert [c.index for c in resp.choices] == list(range(6))
    offline = llm.generate([PROMPT, "hello"], SamplingParams(
        n=3, temperature=2.0, seed=9, max_tokens=16, **NOISY), use_tqdm=False)
    assert [c.text for c in resp.choices] == [c.text for o in offline for c in o.outputs]
    assert len({c.text for c in resp.choices[:3]}) > 1
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for o in offline
                                               for c in o.outputs)
    again = _complete(client, prompt=[PROMPT, "hello"], n=3, temperature=2.0, seed=9, **NOISY)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    chat = client.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=8,
                                          n=3, temperature=2.0)
    assert [c.index for c in chat.choices] == [0, 1, 2]


def test_n_streams_per_choice_deltas(client) -> None:
    kwargs = dict(n=2, temperature=2.0, seed=4, logprobs=2, **NOISY)
    full = _complete(client, **kwargs)
    chunks = list(_complete(client, stream=True, **kwargs))
    for choice in full.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        tokens = [t for c in mine if c.logprobs for t in c.logprobs.tokens]
        offsets = [o for c in mine if c.logprobs for o in c.logprobs.text_offset]
        assert tokens == choice.logprobs.tokens and offsets == choice.logprobs.text_offset
    assert len({c.choices[0].index for c in chunks if c.choices}) == 2


def test_completion_logprobs_carry_chosen_and_top_k(client, llm) -> None:
    k = 3
    resp = _complete(client, logprobs=k, temperature=1.0, seed=2, **NOISY)
    choice = resp.choices[0]
    (ref,) = llm.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=2,
                                                   logprobs=k, **NOISY), use_tqdm=False)
    c = ref.outputs[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(c.token_ids)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top, token_id, entry in zip(lp.tokens, lp.token_logprobs,
                                                  lp.top_logprobs, c.token_ids, c.logprobs):
        assert token == entry[token_id].decoded_token
        assert value == pytest.approx(entry[token_id].logprob)
        assert token in top and len(top) in (k, k + 1)
        assert sorted(top.values(), reverse=True)[:k] == sorted(
            (lp.logprob for lp in entry.values() if lp.rank <= k), reverse=True)


def test_chat_logprobs_and_top_logprobs(client) -> None:
    k = 2
    kwargs = dict(model="test-model", messages=MESSAGES, max_tokens=16, logprobs=True,
                  top_logprobs=k)
    resp = client.chat.completions.create(**kwargs)
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens > 0
    for item in content:
        assert item.logprob <= 0 and item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == k
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert item.logprob <= values[0]
        assert item.token in [t.token for t in item.top_logprobs] or item.logprob <= values[-1]
    stream = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [i for c in stream if c.choices and c.choices[0].logprobs
                for i in c.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == choice.message.content
    plain = client.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=8)
    assert plain.choices[0].logprobs is None


def test_stop_reason_in_choices(client, server) -> None:
    free = _complete(client, **NOISY).choices[0]
    stop = free.text[2:4]
    url = server.url + "/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 16, **NOISY}
    got = httpx.post(url, json={**body, "stop": [stop]}).json()["choices"][0]
    assert got["finish_reason"] == "stop" and got["stop_reason"] == stop
    assert httpx.post(url, json=body).json()["choices"][0]["stop_reason"] is None
    chunks = [json.loads(line[6:]) for line in httpx.post(
        url, json={**body, "stop": [stop], "stream": True}).text.splitlines()
        if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    with_lp = {**body, "stop": [stop], "logprobs": 1}      # tokens wait for the stop check
    full = httpx.post(url, json=with_lp).json()["choices"][0]
    chunks = [json.loads(line[6:]) for line in httpx.post(
        url, json={**with_lp, "stream": True}).text.splitlines() if line.startswith("data: {")]
    streamed = [t for c in chunks if c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == full["logprobs"]["tokens"]


def test_return_token_ids(client, llm) -> None:
    resp = _complete(client, return_token_ids=True, **NOISY)
    (ref,) = llm.generate([PROMPT], SamplingParams(max_tokens=16, **NOISY), use_tqdm=False)
    extra = resp.choices[0].model_extra
    assert extra["token_ids"] == ref.outputs[0].token_ids
    assert extra["prompt_token_ids"] == ref.prompt_token_ids
    assert "token_ids" not in (_complete(client, **NOISY).choices[0].model_extra or {})
    chat = client.chat.completions.create(model="test-model", messages=MESSAGES, max_tokens=8,
                                          extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] and chat.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize("body,param,words", [
    ({"n": 0}, "n", "1 to 64"), ({"n": 65}, "n", "1 to 64"), ({"logprobs": 21}, "logprobs",
                                                               "0 to 20"),
    ({"logprobs": -1}, "logprobs", "0 to 20"),
    ({"decoding": "threshold", "decoding_params": {"threshold": "high"}}, "decoding_params",
     "decoding_params.threshold must be a number")])
def test_bad_n_logprobs_and_param_types_are_400s(server, body, param, words) -> None:
    resp = httpx.post(server.url + "/v1/completions",
                      json={"prompt": PROMPT, "max_tokens": 4, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("body,param", [({"top_logprobs": 2}, "top_logprobs"),
                                        ({"logprobs": True, "top_logprobs": 30},
                                         "top_logprobs")])
def test_bad_chat_logprobs_are_400s(server, body, param) -> None:
    resp = httpx.post(server.url + "/v1/chat/completions",
                      json={"messages": MESSAGES, "max_tokens": 4, **body})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_model_without_tokenizer_returns_token_ids(tmp_path, caplog) -> None:
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(BUILTIN_DIRS["cover-tiny"] / name, model / name)
    with caplog.at_level(logging.WARNING):
        srv = start_server(str(model))
    try:
        assert "no tokenizer" in caplog.text and "choices[].token_ids" in caplog.text
        prompt = [106, 138, 85]
        resp = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 8, "logprobs": 1}).json()
        choice = resp["choices"][0]
        assert choice["text"] == "" and choice["prompt_token_ids"] == prompt
        assert len(choice["token_ids"]) == resp["usage"]["completion_tokens"] > 0
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        off = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 8, "return_token_ids": False}).json()
        assert "token_ids" not in off["choices"][0]
    finally:
        srv.stop()

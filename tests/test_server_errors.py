"""Bad input never breaks the server: every case gets a 4xx with an OpenAI-style error body that
names the problem, and a good request right after it still works."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serve_helpers import serving_model, start_server  # noqa: E402

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "hello world", "max_tokens": 4}
MSG = [{"role": "user", "content": "hello"}]


def _c(**fields) -> dict:
    return {"model": "test-model", **OK, **fields}


def _without(key: str) -> dict:
    body = _c()
    body.pop(key)
    return body


# (id, path, body: dict | bytes, status, param the error must name, code or None)
CASES = [
    ("missing prompt", C, _without("prompt"), 400, "prompt", "missing"),
    ("empty prompt", C, _c(prompt=""), 400, "prompt", None),
    ("empty prompt list", C, _c(prompt=[]), 400, "prompt", None),
    ("prompt wrong type", C, _c(prompt=123), 400, "prompt", None),
    ("prompt mixed list", C, _c(prompt=[1, "a"]), 400, "prompt", None),
    ("prompt ids out of vocab", C, _c(prompt=[10**9]), 400, "prompt", None),
    ("max_tokens zero", C, _c(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens negative", C, _c(max_tokens=-3), 400, "max_tokens", None),
    ("max_tokens as string", C, _c(max_tokens="16"), 400, "max_tokens", None),
    ("max_tokens over the limit", C, _c(max_tokens=10**6), 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt longer than max_model_len", C, _c(prompt=[5] * 600), 400, "prompt",
     "context_length_exceeded"),
    ("chat messages longer than max_model_len", CHAT,
     {"messages": [{"role": "user", "content": "1 " * 600}], "max_tokens": 4}, 400, "messages",
     "context_length_exceeded"),
    ("negative temperature", C, _c(temperature=-0.5), 400, "temperature", None),
    ("top_p above one", C, _c(top_p=1.5), 400, "top_p", None),
    ("top_p zero", C, _c(top_p=0), 400, "top_p", None),
    ("unknown decoding", C, _c(decoding="telepathy"), 400, "decoding", None),
    ("unknown model", C, _c(model="gpt-9"), 404, "model", "model_not_found"),
    ("invalid JSON", C, b'{"prompt": "hi", "max_tokens": ', 400, None, "invalid_json"),
    ("NaN literal", C, b'{"prompt": "hi", "temperature": NaN}', 400, None, "invalid_json"),
    ("body not an object", C, b'["hello"]', 400, None, "invalid_json"),
    ("oversized body", C, json.dumps(_c(prompt="hello " * 200_000)).encode(), 413, None,
     "request_too_large"),
    ("non-UTF-8 bytes", C, b'{"prompt": "caf\xe9 \xff\xfe", "max_tokens": 4}', 400, None,
     "invalid_encoding"),
    ("block_length zero", C, _c(block_length=0), 400, "block_length", None),
    ("block_length negative", C, _c(block_length=-8), 400, "block_length", None),
    ("steps zero", C, _c(steps=0), 400, "steps", None),
    ("steps above max_tokens", C, _c(steps=1000, max_tokens=8), 400, "steps", None),
    ("stop_token_ids out of vocab", C, _c(stop_token_ids=[10**6]), 400, "stop_token_ids", None),
    ("unknown decoding_params key", C, _c(decoding="threshold",
                                          decoding_params={"bogus": 1}), 400,
     "decoding_params", None),
    ("decoding_params wrong type", C, _c(decoding_params="fast"), 400, "decoding_params",
     None),
    ("n zero", C, _c(n=0), 400, "n", None),
    ("n above the cap", C, _c(n=1000), 400, "n", None),
    ("echo with stream", C, _c(echo=True, stream=True), 400, "stream", None),
    ("logprobs above the cap", C, _c(logprobs=21), 400, "logprobs", None),
    ("logprobs negative", C, _c(logprobs=-1), 400, "logprobs", None),
    ("decoding_params value wrong type", C, _c(decoding="threshold",
                                               decoding_params={"threshold": "high"}), 400,
     "decoding_params", None),
    ("stream wrong type", C, _c(stream="yes"), 400, "stream", None),
    ("unknown field", C, _c(decodng="cover"), 400, "decodng", "extra_forbidden"),
    ("bad kv_cache", C, _c(kv_cache="quad"), 400, "kv_cache", None),
    ("bad cache_refresh", C, _c(cache_refresh="sometimes"), 400, "cache_refresh", None),
    ("cache_refresh interval zero", C, _c(cache_refresh="interval:0"), 400, "cache_refresh",
     None),
    ("cache_refresh wrong type", C, _c(cache_refresh=2), 400, "cache_refresh", None),
    ("negative seed", C, _c(seed=-1), 400, "seed", None),
    ("empty stop string", C, _c(stop=[""]), 400, "stop", None),
    ("chat without messages", CHAT, {"model": "test-model"}, 400, "messages", "missing"),
    ("chat empty messages", CHAT, {"messages": []}, 400, "messages", None),
    ("chat bad role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.0.role", None),
    ("chat content wrong type", CHAT, {"messages": [{"role": "user", "content": 7}]}, 400,
     "messages.0.content", None),
    ("chat n negative", CHAT, {"messages": MSG, "n": -1}, 400, "n", None),
    ("chat top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("chat logprobs wrong type", CHAT, {"messages": MSG, "logprobs": 2}, 400, "logprobs",
     None),
    ("chat negative temperature", CHAT, {"messages": MSG, "temperature": -1}, 400,
     "temperature", None),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(serving_model(tmp_path_factory.mktemp("serve-errors")), max_num_seqs=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _assert_error(resp, status: int, param: str | None, code: str | None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert param.split(".")[-1] in error["message"] or param.split(".")[0] in \
            error["message"], error
    return error


def _good(http) -> None:
    resp = http.post(C, json=_c())
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_and_server_keeps_serving(http, name, path, body, status, param,
                                                     code) -> None:
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = http.post(path, json=body)
    _assert_error(resp, status, param, code)
    _good(http)


@pytest.mark.parametrize("policy", ["block", "interval:2", "adaptive"])
def test_cache_refresh_body_field_is_accepted(http, policy) -> None:
    resp = http.post(C, json=_c(cache_refresh=policy, kv_cache="dual", max_tokens=8))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_bad_input_on_a_stream_is_refused_before_streaming(http) -> None:
    resp = http.post(C, json=_c(stream=True, max_tokens=0))
    _assert_error(resp, 400, "max_tokens", None)
    assert resp.headers["content-type"].startswith("application/json")
    _good(http)


def test_unknown_route_and_wrong_method(http) -> None:
    resp = http.get("/v1/nothing-here")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    resp = http.get(C)
    assert resp.status_code == 405 and resp.json()["error"]["code"] == "method_not_allowed"
    _good(http)


def test_many_bad_requests_do_not_leak_pages(http) -> None:
    for _ in range(3):
        for name, path, body, *_ in CASES[:10]:
            if isinstance(body, dict):
                http.post(path, json=body)
    metrics = http.get("/metrics").text
    used = [line for line in metrics.splitlines() if line.startswith("cover_vllm_kv_pages_used")]
    assert used and float(used[0].split()[-1]) == 0.0
    _good(http)


def test_union_field_errors_name_the_field(http) -> None:
    _assert_error(http.post(C, json=_c(stop=5)), 400, "stop", None)
    _assert_error(http.post(C, json=_c(temperature="hot")), 400, "temperature", None)
    _assert_error(http.post(C, json=_c(stream_options={"include_usage": 1})), 400,
                  "stream_options.include_usage", None)
    _good(http)

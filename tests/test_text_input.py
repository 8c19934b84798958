"""Text that is not valid Unicode (lone UTF-16 surrogates) is refused by name on every route and
offline, and an error (a refused body, or an unexpected exception's 500) leaves the keep-alive
connection serving the next request (issue #52)."""

from __future__ import annotations

import http.client
import json

import pytest

pytest.importorskip("fastapi")

from serve_helpers import serving_model  # noqa: E402

from cover_vllm import LLM, SamplingParams  # noqa: E402
from cover_vllm.text_input import check_text  # noqa: E402

GOOD_COMPLETION = {"prompt": "what is 1 + 2 ?", "max_tokens": 4, "block_length": 4}
GOOD_CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
             "block_length": 4}
# (route, JSON body text as sent, the field a 400 must name); JSON escapes written by hand
BAD = [
    ("/v1/completions", r'{"prompt": "\ud800abc", "max_tokens": 4}', "prompt"),
    ("/v1/completions", r'{"prompt": ["hello", "a\udc00"], "max_tokens": 4}', "prompt"),
    ("/v1/completions", r'{"prompt": "\udc00\ud800 reversed pair", "max_tokens": 4}', "prompt"),
    ("/v1/completions", r'{"prompt": "bad escape \x41", "max_tokens": 4}', None),
    ("/v1/completions", r'{"prompt": "hello", "continuation": " \udc00", "echo": true, '
     r'"logprobs": 1, "max_tokens": 0}', "continuation"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "system", "content": "hi"}, {"role": '
     r'"user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": '
     r'"x\udfff\u0000"}]}]}', "messages.1.content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud83d\ude00\ud800'
     r'"}]}', "messages.0.content"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from cover_vllm.config import EngineConfig
    from cover_vllm.engine.engine import Engine
    from cover_vllm.entrypoints.server import ServerThread
    from cover_vllm.entrypoints.server.app import build_app

    model = serving_model(tmp_path_factory.mktemp("text-model"))
    app = build_app(Engine(EngineConfig(model=model, decoding="low_confidence")), "test-model")

    async def boom():                       # a bug in a route: an exception nothing handles
        raise RuntimeError("an unexpected failure")

    app.add_api_route("/boom", boom, methods=["GET"])
    srv = ServerThread(app=app).start()
    yield srv
    srv.stop()


def _post(conn: http.client.HTTPConnection, path: str, body: str) -> tuple[int, dict]:
    conn.request("POST", path, body=body.encode("utf-8"),
                 headers={"Content-Type": "application/json", "Connection": "keep-alive"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


@pytest.mark.parametrize("route, body, field", BAD)
def test_bad_text_is_a_400_and_the_connection_serves_on(server, route, body, field) -> None:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        status, out = _post(conn, route, body)
        assert status == 400, out
        assert out["error"]["param"] == field, out
        if field is not None:
            assert "surrogate" in out["error"]["message"]
        for path, good in (("/v1/completions", GOOD_COMPLETION), ("/v1/chat/completions",
                                                                  GOOD_CHAT)):
            status, out = _post(conn, path, json.dumps(good))     # the same connection
            assert status == 200, out
            assert out["choices"]
    finally:
        conn.close()


def test_nul_and_surrogate_pairs_are_text(server) -> None:
    """NUL is a valid character and an escaped surrogate pair is one character: both serve."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        for route, body in (
                ("/v1/completions", r'{"prompt": "hello\u0000 \ud83d\ude00", "max_tokens": 4}'),
                ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": '
                 r'"a\u0000\ud83d\ude00"}], "max_tokens": 4}')):
            status, out = _post(conn, route, body)
            assert status == 200, out
    finally:
        conn.close()


def test_an_unexpected_exception_is_a_500_and_the_connection_serves_on(server) -> None:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        conn.request("GET", "/boom")
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 500
        assert body["error"] == {"message": "internal server error: RuntimeError",
                                 "type": "server_error", "param": None, "code": None}
        status, out = _post(conn, "/v1/completions", json.dumps(GOOD_COMPLETION))
        assert status == 200, out
    finally:
        conn.close()


def test_check_text() -> None:
    assert check_text("a\x00b\U0001F600") == "a\x00b\U0001F600"
    with pytest.raises(ValueError, match=r"prompt is not valid Unicode.*U\+D800 at character 1"):
        check_text("a\ud800")
    with pytest.raises(ValueError, match="messages must be a string"):
        check_text(5, "messages")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(serving_model(tmp_path_factory.mktemp("text-offline")),
               decoding="low_confidence")


def test_offline_surrogates_are_value_errors(llm) -> None:
    params = SamplingParams(max_tokens=4, block_length=4)
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        llm.generate(["hello", "\ud800abc"], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content: content is not valid"):
        llm.chat([{"role": "user", "content": "x\udc00"}], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"content\[1\]\.text is not valid"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "\ud800"}]}], params,
                 use_tqdm=False)
    with pytest.raises(ValueError, match="context is not valid Unicode"):
        llm.loglikelihood(("\ud800", " b"), use_tqdm=False)
    with pytest.raises(ValueError, match="text is not valid Unicode"):
        llm.get_tokenizer().encode("\ud800")
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("hello\x00", params, use_tqdm=False)[0].outputs

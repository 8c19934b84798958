"""vLLM's names a user reaches for (issue #52): SamplingParams(max_tokens=None) and .clone,
cover_vllm.inputs' TokensPrompt / TextPrompt, GET /version, the `vllm:` metric series,
stream_options only with stream, and a body that is not application/json."""

from __future__ import annotations


import httpx
import pytest

from cover_vllm import LLM, SamplingParams
from cover_vllm.inputs import TextPrompt, TokensPrompt


@pytest.fixture(scope="module")
def llm():
    return LLM("cover-tiny", num_threads=1, decoding="low_confidence")


def test_max_tokens_none_is_up_to_the_models_length(llm) -> None:
    ids = llm.get_tokenizer().encode("12+34=", add_special_tokens=False)
    limit = llm.engine.spec.max_model_len
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=None,
                                                               ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == limit - len(ids)
    full = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        max_tokens=limit - len(ids), ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == full.outputs[0].token_ids
    with pytest.raises(ValueError, match="leaves no room"):
        llm.generate({"prompt_token_ids": [5] * limit}, SamplingParams(max_tokens=None),
                     use_tqdm=False)
    assert SamplingParams(max_tokens=None, min_tokens=3).max_tokens is None


def test_clone_is_a_deep_copy() -> None:
    p = SamplingParams(max_tokens=8, stop=["x"], decoding_params={"threshold": 0.9})
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.decoding_params["threshold"] = 0.5
    assert p.stop == ["x"] and p.decoding_params == {"threshold": 0.9}


def test_tokens_and_text_prompts(llm) -> None:
    params = SamplingParams(max_tokens=8)
    text = llm.generate("12+34=", params, use_tqdm=False)[0]
    ids = text.prompt_token_ids
    as_text = llm.generate(TextPrompt(prompt="12+34="), params, use_tqdm=False)[0]
    as_tokens = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    assert as_text.prompt == "12+34="
    assert as_text.outputs[0].token_ids == as_tokens.outputs[0].token_ids == \
        text.outputs[0].token_ids
    import cover_vllm

    assert (cover_vllm.TextPrompt, cover_vllm.TokensPrompt) == (TextPrompt, TokensPrompt)
    with pytest.raises(TypeError, match="TextPrompt's 'prompt' must be a string"):
        llm.generate({"prompt": 5}, params, use_tqdm=False)


pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def server():
    from serve_helpers import start_server

    srv = start_server("cover-tiny")
    yield srv
    srv.stop()


def test_version(server) -> None:
    from cover_vllm import __version__

    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_vllm_metric_aliases(server) -> None:
    label = '{model_name="test-model"}'
    before = _metrics(server)
    body = {"prompt": "12+34=", "max_tokens": 8}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    after = _metrics(server)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew(f"vllm:prompt_tokens_total{label}") == out["usage"]["prompt_tokens"]
    assert grew(f"vllm:generation_tokens_total{label}") == out["usage"]["completion_tokens"]
    assert grew("cover_vllm_prompt_tokens_total") == out["usage"]["prompt_tokens"]
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert grew(f"{name}_count{label}") == 1
        assert grew(f"{name}_sum{label}") > 0
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert after[f"{name}{label}"] == after[name.replace("vllm:", "cover_vllm_")]


def test_stream_options_need_stream(server) -> None:
    body = {"prompt": "12+34=", "max_tokens": 4, "stream_options": {"include_usage": True}}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "stream_options"
    assert "only be given with stream=true" in resp.json()["error"]["message"]


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_is_refused(server, content_type) -> None:
    headers = {"content-type": content_type} if content_type else {}
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = httpx.post(server.url + path, content=b'{"prompt": "1+1=", "max_tokens": 4}',
                          headers=headers, timeout=120)
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "unsupported_media_type"
    ok = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "1+1=", "max_tokens": 4}',
                    headers={"content-type": "application/json; charset=utf-8"}, timeout=120)
    assert ok.status_code == 200

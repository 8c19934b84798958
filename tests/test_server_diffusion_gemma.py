"""DiffusionGemma over the OpenAI server (issue 32): the golden checkpoint (no tokenizer: token-id
prompts, token-id answers) reproduces the golden generate cases over HTTP, with `n`, logprobs
from each canvas's final step, streaming of finished canvases and 400s naming bad knobs; a copy
with a word-level tokenizer serves stop strings and chat, and refuses structured outputs with
the reason.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

pytest.importorskip("fastapi")

from serve_helpers import start_server  # noqa: E402
from test_diffusion_gemma_engine import COMPARABLE, DIR, dg_params, expected  # noqa: E402

from cover_vllm import LLM  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w3{% endif %}")


def _body(case: dict, **changes) -> dict:
    p = dg_params(case)
    return {"prompt": case["prompt_ids"][0], "max_tokens": p.max_tokens, "seed": p.seed,
            "decoding_params": p.decoding_params, **changes}


@pytest.fixture(scope="module")
def server():
    srv = start_server(str(DIR / "model"), decoding=None, num_threads=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    """The golden checkpoint with a word-level tokenizer: token i is the word "w<i>"."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("dg-words")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(DIR / "model" / name, path / name)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0", "pad_token": "w0",
        "eos_token": "w1", "bos_token": "w2", "chat_template": CHAT_TEMPLATE}))
    srv = start_server(str(path), decoding=None, num_threads=1)
    yield srv
    srv.stop()


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


def test_the_golden_cases_over_http(server):
    """Every comparable case, token ids in and out, its seed and knobs in the body: the golden
    tokens, finish reasons and decoder forwards (choices[].metrics)."""
    for case in COMPARABLE:
        resp = _post(server, "/v1/completions", _body(case))
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["text"] == "" and choice["token_ids"] == expected(case), case["name"]
        finish = "stop" if case["eos_index"][0] is not None else "length"
        assert choice["finish_reason"] == finish
        assert resp.json()["usage"]["completion_tokens"] == len(expected(case))


def test_n_and_logprobs_as_offline(server):
    case = COMPARABLE[5]
    resp = _post(server, "/v1/completions", _body(case, n=3, logprobs=2)).json()
    offline = LLM(str(DIR / "model"), num_threads=1).generate(
        [{"prompt_token_ids": case["prompt_ids"][0]}], dg_params(case, n=3, logprobs=2),
        use_tqdm=False)[0]
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert resp["choices"][0]["token_ids"] == expected(case)
    for choice, comp in zip(resp["choices"], offline.outputs):
        assert choice["token_ids"] == comp.token_ids
        lp = choice["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in comp.token_ids]
        want = [d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs)]
        assert lp["token_logprobs"] == pytest.approx(want, abs=1e-6)
        assert all(len(top) == 3 or len(top) == 2 for top in lp["top_logprobs"])


def test_streaming_sends_each_canvas_when_it_is_final(server):
    """A 3-canvas request streams its tokens in three deltas of 16 (one per finished canvas)."""
    case = next(c for c in COMPARABLE if c["name"] == "dg_bound2_steps12_3canvas")
    deltas = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json=_body(case, stream=True)) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice.get("token_ids"):
                    deltas.append(choice["token_ids"])
    assert [len(d) for d in deltas] == [16, 16, 16]
    assert sum(deltas, []) == expected(case)


@pytest.mark.parametrize("changes, param", [
    ({"temperature": 0.7}, "temperature"), ({"top_p": 0.5}, "top_p"), ({"top_k": 3}, "top_k"),
    ({"steps": 4}, "steps"), ({"block_length": 8}, "block_length"),
    ({"kv_cache": "none"}, "kv_cache"), ({"decoding_params": {"t_max": -1}}, "decoding_params"),
    ({"decoding_params": {"bound": 1}}, "decoding_params"), ({"decoding": "cover"}, "decoding"),
    ({"max_tokens": 5000}, "max_tokens")])
def test_bad_knobs_are_400s_naming_them(server, changes, param):
    resp = _post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 16, **changes})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert resp.status_code == 400
    again = _post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 16})
    assert again.status_code == 200


def test_stop_strings_chat_and_the_structured_outputs_refusal(worded):
    case = next(c for c in COMPARABLE if c["name"] == "dg_bound2_steps12_3canvas")
    tokens = expected(case)
    at = next(i for i in range(16, 32) if tokens[i] not in tokens[:i])
    resp = _post(worded, "/v1/completions", _body(case, stop=f"w{tokens[at]}")).json()
    choice = resp["choices"][0]
    assert choice["text"] == " ".join(f"w{t}" for t in tokens[:at]) + " "
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == f"w{tokens[at]}"
    chat = _post(worded, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 16,
        "decoding_params": {"max_denoising_steps": 2}})
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]
    refused = _post(worded, "/v1/completions", {
        "prompt": "w5 w6", "max_tokens": 16, "structured_outputs": {"regex": "w[0-9]+"}})
    assert refused.status_code == 400
    err = refused.json()["error"]
    assert err["param"] == "structured_outputs" and "re-drawn" in err["message"]
    schema = _post(worded, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "w7"}], "max_tokens": 16,
        "response_format": {"type": "json_object"}})
    assert schema.status_code == 400 and "uniform-state" in schema.json()["error"]["message"]
    image = _post(worded, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "w7"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
        "max_tokens": 16})
    assert image.status_code == 400 and "image_url" in image.json()["error"]["message"]
    assert _post(worded, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "w7"}], "max_tokens": 16,
        "decoding_params": {"max_denoising_steps": 2}}).status_code == 200

"""The OpenAI-compatible server through the official `openai` client: models, completions, chat,
streaming == non-streaming at temperature 0, parity with offline LLM.generate, /metrics,
/health, the API key, and one failing request not taking others down."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_helpers import PROMPTS, serving_model, start_server  # noqa: E402

from cover_vllm import LLM, SamplingParams  # noqa: E402

KNOBS = {"block_length": 8, "kv_cache": "dual"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return serving_model(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def server(model):
    srv = start_server(model)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(model):
    llm = LLM(model, decoding="low_confidence")
    params = SamplingParams(max_tokens=24, temperature=0.0, block_length=8, kv_cache="dual")
    return {o.prompt: o for o in llm.generate(PROMPTS[:6], params, use_tqdm=False)}


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_models_and_health(client, server) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["test-model"]
    assert client.models.retrieve("test-model").id == "test-model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completions_match_offline(client, offline) -> None:
    for prompt, ref in offline.items():
        resp = client.completions.create(model="test-model", prompt=prompt, max_tokens=24,
                                         temperature=0, extra_body=KNOBS)
        choice = resp.choices[0]
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
        assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_batch_and_token_id_prompts(client, offline) -> None:
    prompts = list(offline)[:3]
    resp = client.completions.create(model="test-model", prompt=prompts, max_tokens=24,
                                     temperature=0, extra_body=KNOBS)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [offline[p].outputs[0].text for p in prompts]
    ids = offline[prompts[0]].prompt_token_ids
    resp = client.completions.create(model="test-model", prompt=ids, max_tokens=24,
                                     temperature=0, extra_body=KNOBS)
    assert resp.choices[0].text == offline[prompts[0]].outputs[0].text


def test_stream_equals_non_stream(client, offline) -> None:
    for prompt in list(offline)[:3]:
        full = client.completions.create(model="test-model", prompt=prompt, max_tokens=24,
                                         temperature=0, extra_body=KNOBS).choices[0]
        chunks = list(client.completions.create(model="test-model", prompt=prompt,
                                                max_tokens=24, temperature=0, stream=True,
                                                extra_body=KNOBS))
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == full.text
        assert chunks[-1].choices[0].finish_reason == full.finish_reason
        if full.finish_reason == "length" and len(full.text) > 0:
            assert sum(1 for t in texts if t) >= 2        # one delta per FINAL block


def test_chat_and_chat_stream(client) -> None:
    messages = [{"role": "user", "content": "what is 1 + 2 ?"}]
    full = client.chat.completions.create(model="test-model", messages=messages, max_tokens=24,
                                          temperature=0, extra_body=KNOBS)
    message = full.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    stream = client.chat.completions.create(model="test-model", messages=messages,
                                            max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body=KNOBS)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_diffusion_knobs_and_metrics(client, server) -> None:
    before = httpx.get(server.url + "/metrics").text
    resp = client.completions.create(
        model="test-model", prompt=PROMPTS[0], max_tokens=16, temperature=0,
        extra_body={"decoding": "threshold", "block_length": 8, "kv_cache": "prefix",
                    "decoding_params": {"threshold": 0.5}})
    assert resp.choices[0].finish_reason in ("stop", "length")
    after = httpx.get(server.url + "/metrics").text
    for name in ("cover_vllm_requests_total", "cover_vllm_num_requests_running",
                 "cover_vllm_num_requests_waiting", "cover_vllm_generation_tokens_total",
                 "cover_vllm_nfe_per_token", "cover_vllm_remasks_total",
                 "cover_vllm_flip_flops_total", "cover_vllm_kv_pages_used",
                 "cover_vllm_kv_pages_total"):
        assert name in after, name
    assert _metric(after, "cover_vllm_requests_total") == \
        _metric(before, "cover_vllm_requests_total") + 1
    assert _metric(after, "cover_vllm_generation_tokens_total") > 0
    assert _metric(after, "cover_vllm_kv_pages_total") > 0
    assert _metric(after, "cover_vllm_kv_pages_used") == 0          # nothing running now
    assert _metric(after, "cover_vllm_nfe_per_token") > 0


def test_api_key(model) -> None:
    srv = start_server(model, api_key="sesame", max_num_seqs=4)
    try:
        bad = openai.OpenAI(api_key="wrong", base_url=srv.url + "/v1", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(api_key="sesame", base_url=srv.url + "/v1", max_retries=0)
        assert good.models.list().data[0].id == "test-model"
        assert httpx.get(srv.url + "/health").status_code == 200       # health stays open
    finally:
        srv.stop()


def test_engine_failure_fails_only_that_request(client, server, offline) -> None:
    """A forward that raises whenever one poisoned request is in the batch: the batch is
    replayed in halves, only the poisoned request fails, the others equal offline."""
    engine = server.engine_loop.engine
    poisoned: set[str] = set()
    real_add, real_execute = engine.add_request, engine.executor.execute_model
    poison = [5, 5, 5, 5]                                  # a prompt nobody else sends

    def add(request_id, prompt, params):
        if isinstance(prompt, dict) and prompt.get("prompt_token_ids") == poison:
            poisoned.add(request_id)
        return real_add(request_id, prompt, params)

    def execute(out):
        if any(item.request_id in poisoned for item in out.items):
            raise RuntimeError("injected fault")
        return real_execute(out)

    engine.add_request, engine.executor.execute_model = add, execute
    try:
        def good(prompt):
            return client.completions.create(model="test-model", prompt=prompt, max_tokens=24,
                                             temperature=0, extra_body=KNOBS).choices[0].text

        def bad():
            with pytest.raises(openai.InternalServerError, match="injected fault"):
                client.completions.create(model="test-model", prompt=poison, max_tokens=24,
                                          temperature=0, extra_body=KNOBS)
            return "failed as expected"

        with cf.ThreadPoolExecutor(8) as pool:
            jobs = {p: pool.submit(good, p) for p in offline}
            poisoned_job = pool.submit(bad)
            assert poisoned_job.result() == "failed as expected"
            for prompt, job in jobs.items():
                assert job.result() == offline[prompt].outputs[0].text
        assert server.engine_loop.num_failed_steps >= 1
    finally:
        engine.add_request, engine.executor.execute_model = real_add, real_execute
    assert good(PROMPTS[0]) == offline[PROMPTS[0]].outputs[0].text


def test_saber_streams_only_finished_text(client) -> None:
    """Saber may still revise finished blocks, so its stream holds text until the end."""
    knobs = {**KNOBS, "decoding": "saber"}
    full = client.completions.create(model="test-model", prompt=PROMPTS[1], max_tokens=16,
                                     temperature=0, extra_body=knobs).choices[0]
    chunks = list(client.completions.create(model="test-model", prompt=PROMPTS[1],
                                            max_tokens=16, temperature=0, stream=True,
                                            extra_body=knobs))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(texts) == full.text
    assert len(texts) <= 1


def test_max_tokens_defaults_to_the_checkpoint_generation_length(client, model) -> None:
    want = LLM(model, kv_cache="none").get_default_sampling_params().max_tokens
    extra = {"ignore_eos": True, "block_length": 8}
    chat = client.chat.completions.create(model="test-model", extra_body=extra,
                                          messages=[{"role": "user", "content": "1+2="}])
    completion = client.completions.create(model="test-model", prompt="1+2=", extra_body=extra)
    if model == "cover-tiny":                        # ships generation_config.json: 32
        assert want == 32
        assert chat.usage.completion_tokens == completion.usage.completion_tokens == 32
    else:                                            # none: OpenAI's defaults, 64 and 16
        assert (chat.usage.completion_tokens, completion.usage.completion_tokens) == (64, 16)

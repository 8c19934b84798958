"""The server under load and under client disconnects.

Many concurrent streaming clients (the `bench serve` load generator) for a fixed time: no errors,
no lost or truncated responses, every streamed text equal to offline LLM.generate at temperature
0. A client that disconnects mid-stream gets its KV pages freed (seen in /metrics) while another
stream carries on to the right answer. The 64-client / 60 s run is marked slow.
"""

from __future__ import annotations

import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serve_helpers import PROMPTS, serving_model, start_server  # noqa: E402

from cover_vllm import LLM, SamplingParams  # noqa: E402
from cover_vllm.benchmarks.serve import ServeBenchSpec, format_table, run_serve_bench  # noqa

DECODING, MAX_TOKENS, BLOCK = "cover", 32, 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return serving_model(tmp_path_factory.mktemp("serve-load"))


@pytest.fixture(scope="module")
def server(model):
    srv = start_server(model, max_num_seqs=64)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(model) -> list:
    llm = LLM(model, decoding=DECODING, kv_cache="dual")
    params = SamplingParams(max_tokens=MAX_TOKENS, block_length=BLOCK, temperature=0.0)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _load(server, reference, concurrency: int, duration: float):
    spec = ServeBenchSpec(url=server.url, concurrency=(concurrency,), duration_s=duration,
                          max_tokens=MAX_TOKENS, prompts=tuple(PROMPTS),
                          extra_body=(("decoding", DECODING), ("block_length", BLOCK)))
    result = run_serve_bench(spec)[0]
    print("\n" + format_table([result]))
    assert result.errors == 0, [r.error for r in result.records if r.error][:3]
    assert result.requests >= concurrency
    for record in result.records:
        ref = reference[record.prompt_index]
        assert record.text == ref.text, (record.prompt_index, record.text, ref.text)
        assert record.finish_reason == ref.finish_reason
        assert record.output_tokens == len(ref.token_ids)
    metrics = httpx.get(server.url + "/metrics").text
    assert "cover_vllm_kv_pages_used 0.0" in metrics          # nothing left holding pages
    return result


@pytest.mark.slow   # 10 s of load
def test_load_short(server, reference) -> None:
    _load(server, reference, concurrency=16, duration=10.0)


@pytest.mark.slow
def test_load_64_clients_60s(server, reference) -> None:
    result = _load(server, reference, concurrency=64, duration=60.0)
    assert result.requests > 64


def test_bench_serve_cli(server, capsys) -> None:
    from cover_vllm.entrypoints.cli import main

    code = main(["bench", "serve", "--url", server.url, "--concurrency", "1,2",
                 "--duration", "1", "--max-tokens", "8", "--prompt", PROMPTS[0]])
    out = capsys.readouterr().out
    assert code == 0 and "| concurrency |" in out and out.count("\n| ") >= 2


def test_bench_serve_soak_by_count_samples_the_servers_memory(server, capsys, tmp_path) -> None:
    """`--num-requests` ends a level at a count (no --duration: no time limit); the server's
    RSS and KV pages are read from /metrics at the start, every --sample-every requests and at
    the end."""
    import json

    from cover_vllm.entrypoints.cli import main

    code = main(["bench", "serve", "--url", server.url, "--concurrency", "2", "--num-requests",
                 "6", "--sample-every", "3", "--max-tokens", "8", "--prompt", PROMPTS[0],
                 "--json", str(tmp_path / "soak.json")])
    out = capsys.readouterr().out
    assert code == 0 and "| server RSS MB |" in out
    (row,) = json.loads((tmp_path / "soak.json").read_text())["results"]
    assert row["requests"] == 6 and row["errors"] == 0
    assert [s["requests"] for s in row["samples"]] == [0, 3, 6]
    assert all(s["rss_bytes"] > 1e6 and s["kv_pages_total"] > 0 for s in row["samples"])
    with pytest.raises(ValueError, match="duration_s or num_requests"):
        run_serve_bench(ServeBenchSpec(url=server.url, duration_s=None))


def _metric(http, name: str) -> float:
    lines = [line for line in http.get("/metrics").text.splitlines()
             if line.startswith(name) and not line.startswith("#")]
    return sum(float(line.split()[-1]) for line in lines)


def _wait_metric(http, name: str, value: float, what: str, timeout_s: float = 10.0) -> None:
    """Poll a gauge until it reads `value`: the engine loop delivers a step's outputs before it
    publishes that step's gauges, so one read right after an output may still see the old value."""
    deadline = time.monotonic() + timeout_s
    while _metric(http, name) != value:
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def _stream_body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "decoding": "low_confidence", "steps": max_tokens, "block_length": 8,
            "kv_cache": "none", "ignore_eos": True}


def _read_stream(url: str, body: dict, result: dict) -> None:
    with httpx.Client(base_url=url, timeout=300) as client:
        with client.stream("POST", "/v1/completions", json=body) as resp:
            import json as _json

            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    result["done"] = True
                elif line.startswith("data: "):
                    choice = _json.loads(line[6:])["choices"][0]
                    result["text"] = result.get("text", "") + choice["text"]
                    result["finish"] = choice["finish_reason"] or result.get("finish")


def test_disconnect_frees_pages_and_others_continue(server, model) -> None:
    http = httpx.Client(base_url=server.url, timeout=60)
    config = server.engine_loop.engine.config
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    prompt = [7, 8, 9, 10]
    max_tokens = min(480, max_len - len(prompt))
    pages = -(-(len(prompt) + max_tokens) // config.page_size)
    aborts_before = _metric(http, 'cover_vllm_requests_total{outcome="abort"}')

    survivor: dict = {}
    thread = threading.Thread(target=_read_stream,
                              args=(server.url, _stream_body(prompt, max_tokens), survivor))
    thread.start()
    with httpx.Client(base_url=server.url, timeout=60) as leaver:
        with leaver.stream("POST", "/v1/completions",
                           json=_stream_body(prompt, max_tokens)) as resp:
            first = next(line for line in resp.iter_lines() if line.startswith("data: "))
            assert first
            _wait_metric(http, "cover_vllm_kv_pages_used", 2 * pages,
                         "both streams never ran together")
    # the leaver is gone: its pages come back while the survivor still holds its own
    _wait_metric(http, "cover_vllm_kv_pages_used", pages,
                 "pages of the disconnected stream were not freed")
    assert "done" not in survivor                     # freed while the other stream ran
    thread.join(300)
    assert survivor.get("done") and survivor["finish"] == "length"
    _wait_metric(http, 'cover_vllm_requests_total{outcome="abort"}', aborts_before + 1,
                 "the disconnect was not counted as an abort")
    _wait_metric(http, "cover_vllm_kv_pages_used", 0, "the survivor's pages were not freed")

    llm = LLM(model, decoding="low_confidence", kv_cache="none")
    ref = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=max_tokens, steps=max_tokens, block_length=8,
                                      ignore_eos=True), use_tqdm=False)[0]
    assert survivor["text"] == ref.outputs[0].text
    http.close()


def test_non_streaming_disconnect_aborts(server) -> None:
    http = httpx.Client(base_url=server.url, timeout=60)
    aborts_before = _metric(http, 'cover_vllm_requests_total{outcome="abort"}')
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    body = {**_stream_body([7, 8, 9, 10], min(400, max_len - 4)), "stream": False}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    _wait_metric(http, 'cover_vllm_requests_total{outcome="abort"}', aborts_before + 1,
                 "the abandoned request was not aborted")
    _wait_metric(http, "cover_vllm_kv_pages_used", 0, "the abandoned request's pages were not freed")
    http.close()

"""`cover-vllm serve` with parallelism: --data-parallel-size 2 (two engine replicas as Ray actors
behind the DPRouter) and --tensor-parallel-size 2 (mp workers), through the real command-line
parser and the official `openai` client: both replicas serve, every output equals offline
LLM.generate at temperature 0; a dead replica turns into errors for its requests and is
restarted while the other serves, a dead TP worker into request errors and a server that shuts
itself down, never a hang."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_helpers import PROMPTS, write_tiny_model  # noqa: E402

from cover_vllm import LLM, SamplingParams  # noqa: E402
from cover_vllm.entrypoints.cli import build_parser  # noqa: E402
from cover_vllm.entrypoints.serve_cli import serve_args  # noqa: E402

KNOBS = {"block_length": 8, "ignore_eos": True}
MAX_TOKENS = 16


def _server(model: str, *flags: str):
    """ServerThread.from_args over what `cover-vllm serve MODEL --port 0 FLAGS` parses to."""
    from cover_vllm.entrypoints.server import ServerThread

    ns = build_parser().parse_args(["serve", model, "--port", "0", "--threads", "1",
                                    "--served-model-name", "test-model", *flags])
    return ServerThread.from_args(serve_args(ns)).start()


def _client(srv):
    return openai.OpenAI(api_key="unused", base_url=srv.url + "/v1", max_retries=0, timeout=60)


def _complete(client, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    resp = client.completions.create(model="test-model", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body=KNOBS)
    return resp.choices[0].text


def _replica_counts(srv) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics").text
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith('cover_vllm_replica_requests_total{replica="')}


def _wait_for(condition, router, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, router.replica_counts()
        time.sleep(0.02)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("serve-dp") / "tiny-llada")


@pytest.fixture(scope="module")
def offline(model) -> dict[str, str]:
    with LLM(model, decoding="cover", num_threads=1) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **KNOBS)
        return {o.prompt: o.outputs[0].text for o in llm.generate(PROMPTS[:8], params,
                                                                   use_tqdm=False)}


@pytest.fixture(scope="module")
def dp_server(model, ray_session):
    srv = _server(model, "--data-parallel-size", "2")
    yield srv
    srv.stop()


@pytest.mark.slow   # Ray actors / worker processes
@pytest.mark.ray
def test_dp2_server_spreads_requests_and_matches_offline(dp_server, offline, ray_session):
    assert httpx.get(dp_server.url + "/health").json() == {"status": "ok"}
    client = _client(dp_server)
    assert [m.id for m in client.models.list().data] == ["test-model"]
    before = _replica_counts(dp_server)
    router = dp_server.engine_loop
    replicas = [r.actor for r in router._replicas]
    # the replicas hold until every request is placed, so none finishes before the last arrives
    # and least-loaded routing must give each replica half of them
    ray_session.get([a.limit_steps.remote(0) for a in replicas], timeout=30)
    with cf.ThreadPoolExecutor(len(offline)) as pool:
        futures = {p: pool.submit(_complete, client, p) for p in offline}
        _wait_for(lambda: [c["in_flight"] for c in router.replica_counts()] == [4, 4], router)
        ray_session.get([a.limit_steps.remote(None) for a in replicas], timeout=30)
        got = {p: f.result(timeout=120) for p, f in futures.items()}
    assert got == offline
    after = _replica_counts(dp_server)
    served = {r: after[r] - before.get(r, 0.0) for r in after}
    assert served == {"0": 4, "1": 4}, served
    stream = client.completions.create(model="test-model", prompt=PROMPTS[0], stream=True,
                                       max_tokens=MAX_TOKENS, temperature=0, extra_body=KNOBS)
    assert "".join(c.choices[0].text for c in stream) == offline[PROMPTS[0]]


@pytest.mark.slow   # Ray actors / worker processes
@pytest.mark.ray
def test_dp2_server_n_and_logprobs_match_offline(dp_server, model):
    """The replicas' engines fan n out themselves: the router passes n and logprobs through."""
    resp = _client(dp_server).completions.create(
        model="test-model", prompt=PROMPTS[:2], n=3, logprobs=2, max_tokens=MAX_TOKENS,
        temperature=1.0, seed=5, extra_body=KNOBS)
    with LLM(model, decoding="cover", num_threads=1) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, n=3, logprobs=2, temperature=1.0, seed=5,
                                **KNOBS)
        ref = [c for o in llm.generate(PROMPTS[:2], params, use_tqdm=False) for c in o.outputs]
    assert [c.index for c in resp.choices] == list(range(6))
    assert [c.text for c in resp.choices] == [c.text for c in ref]
    for choice, c in zip(resp.choices, ref):
        assert choice.logprobs.token_logprobs == pytest.approx(
            [e[t].logprob for t, e in zip(c.token_ids, c.logprobs)], abs=1e-5)


def _metric(srv, series: str) -> float | None:
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return None


@pytest.mark.slow   # Ray actors / worker processes
@pytest.mark.ray
def test_dp_killed_replica_heals_while_the_other_serves(dp_server, offline, ray_session):
    """Runs last on the module's server: it kills replica 1 under load. Its request fails, or
    moves to replica 0 when nothing of it was delivered; /health stays 200 throughout; requests
    sent 5 s or more after the kill all succeed; replica 1 is restarted within 120 s and serves
    again."""
    router = dp_server.engine_loop
    pid = router.infos[1]["pid"]
    client = _client(dp_server)
    replicas = [r.actor for r in router._replicas]
    # both replicas hold until each has one request, so neither can finish before the other is
    # placed; then replica 1 runs 8 steps and holds its request mid-generation until the kill
    ray_session.get([a.limit_steps.remote(0) for a in replicas], timeout=30)
    with cf.ThreadPoolExecutor(2) as pool:          # one long request on each replica
        futures = [pool.submit(_complete, client, PROMPTS[i], 128) for i in range(2)]
        _wait_for(lambda: [c["in_flight"] for c in router.replica_counts()] == [1, 1], router)
        ray_session.get([replicas[0].limit_steps.remote(None), replicas[1].limit_steps.remote(8)],
                        timeout=30)
        _wait_for(lambda: router.replica_counts()[1].get("held"), router)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        errors = [f.exception(timeout=30) for f in futures]            # none hangs
    assert time.monotonic() - killed < 15
    assert errors[0] is None and futures[0].result() == _complete(client, PROMPTS[0], 128)
    # replica 1's request either failed (output had reached the server) or, nothing of it
    # delivered yet, moved to replica 0 and was served whole
    if errors[1] is not None:
        assert isinstance(errors[1], openai.InternalServerError), errors[1]
        assert "replica 1 died" in str(errors[1])
    else:
        assert futures[1].result() == _complete(client, PROMPTS[1], 128)
    later, health = [], []
    while _metric(dp_server, 'cover_vllm_replica_alive{replica="1"}') != 1.0:  # until it's back
        assert time.monotonic() - killed < 120, router.replica_counts()
        health.append(httpx.get(dp_server.url + "/health"))
        prompt = PROMPTS[len(later) % len(offline)]
        if time.monotonic() - killed >= 5:
            later.append((prompt, _complete(client, prompt)))
        time.sleep(0.05)
    assert all(h.status_code == 200 for h in health), [h.text for h in health
                                                       if h.status_code != 200]
    assert any(h.json() == {"status": "degraded", "replicas_down": [1]} for h in health)
    assert all(text == offline[prompt] for prompt, text in later)
    assert httpx.get(dp_server.url + "/health").json() == {"status": "ok"}
    assert _metric(dp_server, 'cover_vllm_replica_restarts_total{replica="1"}') == 1.0
    # the restarted replica serves: replica 0 holds one request, so the next goes to replica 1
    before = _replica_counts(dp_server).get("1", 0.0)
    ray_session.get(replicas[0].limit_steps.remote(0), timeout=30)
    with cf.ThreadPoolExecutor(1) as pool:
        held = pool.submit(_complete, client, PROMPTS[0])
        _wait_for(lambda: router.replica_counts()[0]["in_flight"] == 1, router)
        assert _complete(client, PROMPTS[2]) == offline[PROMPTS[2]]
        ray_session.get(replicas[0].limit_steps.remote(None), timeout=30)
        assert held.result(timeout=60) == offline[PROMPTS[0]]
    assert _replica_counts(dp_server)["1"] == before + 1


@pytest.mark.slow   # Ray actors / worker processes
def test_tp2_mp_server_smoke(model, offline):
    srv = _server(model, "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
    try:
        client = _client(srv)
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        assert _complete(client, PROMPTS[1]) == offline[PROMPTS[1]]
        (pid,) = srv.engine_loop.engine.executor.ranks.pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError, match="died") as failed:
            _complete(client, PROMPTS[3])
        assert time.monotonic() - start < 15
        assert "create a new LLM" not in str(failed.value)      # advice for offline users
        deadline = time.monotonic() + 30
        while srv.running:                       # one engine cannot heal: the server shuts down
            assert time.monotonic() < deadline, "the server did not shut down"
            time.sleep(0.02)
        assert "engine is dead" in srv.fatal_error and "died" in srv.fatal_error
        with pytest.raises(httpx.TransportError):
            httpx.get(srv.url + "/health")
    finally:
        srv.stop()


@pytest.mark.slow   # Ray actors / worker processes
@pytest.mark.parametrize("flags", [
    pytest.param(("--data-parallel-size", "2"), id="dp2", marks=pytest.mark.ray),
    pytest.param(("--tensor-parallel-size", "2"), id="tp2")])
def test_parallel_server_serves_a_block_causal_model(flags, request):
    """The golden SDAR checkpoint (block-causal, no tokenizer: token-id prompts) behind two Ray
    replicas or two mp ranks: a request is served (200, every slot generated)."""
    from golden_cases import GOLDEN

    if flags[0] == "--data-parallel-size":
        request.getfixturevalue("ray_session")
    srv = _server(str(GOLDEN / "sdar" / "model"), *flags)
    try:
        resp = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "test-model", "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 8,
            "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 8
    finally:
        srv.stop()

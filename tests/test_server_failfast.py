"""A server whose engine dies exits, so that a supervisor restarts it: `cover-vllm serve
--tensor-parallel-size 2` in a child process, its rank-1 worker killed with SIGKILL under load.
Every in-flight request (streamed or not) ends with an error, none hangs, the message carries no
advice meant for offline users, and the process exits non-zero within 30 s. Also the watchdog
itself (app.py) over a stand-in engine client, without a model."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from serve_helpers import write_tiny_model  # noqa: E402

BODY = {"model": "test-model", "prompt": "hello world", "max_tokens": 480, "temperature": 0,
        "decoding": "low_confidence", "block_length": 8, "ignore_eos": True}


class _Output:
    """The child's merged stdout/stderr, read by a thread (so the pipe never fills)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._thread.start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def port(self, proc: subprocess.Popen, timeout_s: float = 180.0) -> int:
        deadline = time.monotonic() + timeout_s
        while not (found := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)",
                                      self.text)):
            assert proc.poll() is None and time.monotonic() < deadline, self.text
            time.sleep(0.05)
        return int(found.group(1))


def _rank_pids(parent: int) -> list[int]:
    """The tensor-parallel worker processes (cover_vllm.executor.remote) started by `parent`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"cover_vllm.executor.remote" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("cover_vllm_num_requests_running"))


def _request(url: str, stream: bool) -> str:
    """How the request ended: 'ok', or the error it got (an HTTP error, an SSE error event, a
    stream cut before [DONE])."""
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            if not stream:
                resp = client.post("/v1/completions", json=BODY)
                return "ok" if resp.status_code == 200 else f"HTTP {resp.status_code}: {resp.text}"
            with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        return "ok"
                    if line.startswith("data: ") and "error" in json.loads(line[6:]):
                        return f"error event: {line[6:]}"
                return "stream cut before [DONE]"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.slow   # a server process with two tensor-parallel ranks
def test_tp_worker_killed_under_load_fails_every_request_and_the_server_exits(tmp_path):
    model = write_tiny_model(tmp_path / "tiny-llada")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cover_vllm", "serve", model, "--port", "0", "--threads", "1",
         "--served-model-name", "test-model", "--tensor-parallel-size", "2",
         "--distributed-executor-backend", "mp"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output = _Output(proc)
    try:
        url = f"http://127.0.0.1:{output.port(proc)}"
        (rank1,) = _rank_pids(proc.pid)
        with cf.ThreadPoolExecutor(4) as pool:
            ends = [pool.submit(_request, url, stream) for stream in (True, True, False, False)]
            deadline = time.monotonic() + 60
            while _running(url) < 4:                     # all four are mid-generation
                assert time.monotonic() < deadline and not any(f.done() for f in ends), \
                    [f.result() for f in ends if f.done()]
                time.sleep(0.01)
            os.kill(rank1, signal.SIGKILL)
            killed = time.monotonic()
            results = [f.result(timeout=30) for f in ends]          # none hangs
        assert all(r != "ok" for r in results), results
        assert not any("create a new LLM" in r for r in results), results
        code = proc.wait(timeout=max(1.0, 30 - (time.monotonic() - killed)))
        exited_after = time.monotonic() - killed
        print(f"killed rank 1: requests {results}; server exited {code} after "
              f"{exited_after:.1f} s")
        assert code != 0, output.text
        assert exited_after < 30
        assert "exiting because the engine died" in output.text, output.text
        assert "rank 1" in output.text and "create a new LLM" not in output.text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


class _DyingClient:
    """An EngineClient stand-in whose engine dies when the test says so."""

    def __init__(self):
        self.dead: str | None = None
        self.stopped = False

    def start(self) -> None:
        pass

    def stop(self, timeout: float = 30.0) -> None:
        self.stopped = True

    def health(self) -> str | None:
        return self.dead

    def fatal(self) -> str | None:
        return self.dead


def test_watchdog_shuts_the_server_down_once_the_engine_is_dead():
    import asyncio

    from fastapi import FastAPI

    from cover_vllm.entrypoints.server.app import _watch_engine

    app, client, calls = FastAPI(), _DyingClient(), []
    app.state.fatal_error, app.state.on_fatal = None, calls.append

    async def run():
        watchdog = asyncio.get_running_loop().create_task(_watch_engine(app, client, 0.001))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not watchdog.done() and not calls         # alive: the watchdog only watches
        client.dead = "the engine is dead: WorkerDiedError: rank 1 died"
        await asyncio.wait_for(watchdog, 10)
    asyncio.run(run())
    assert calls == [client.dead] and app.state.fatal_error == client.dead

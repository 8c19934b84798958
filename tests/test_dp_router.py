"""Data parallelism: DPRouter spreads concurrent requests over engine replicas (Ray actors)."""

import asyncio
import os
import signal
import time

import pytest

from cover_vllm import LLM, SamplingParams
from cover_vllm.config import EngineConfig
from cover_vllm.engine.driver import Submission    # what the server hands the router
from conftest import LLADA_DIR

pytestmark = [pytest.mark.ray, pytest.mark.slow]   # Ray actors: slow to start


class ReplicaFailed(Exception):
    """Stands in for the server's EngineRequestError."""


def _params(seed: int, max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, block_length=8, ignore_eos=True, seed=seed)


async def _final(stream):
    while True:
        out = await stream.get()
        if out.finished:
            return out


@pytest.fixture(scope="module")
def router(ray_session):
    from cover_vllm.entrypoints.server.dp_router import DPRouter

    config = EngineConfig(model=LLADA_DIR, decoding="low_confidence", num_threads=1)
    router = DPRouter(config, 2, error_cls=ReplicaFailed, poll_s=0.2)
    yield router
    router.stop()


def test_dp2_serves_concurrent_requests_from_both_replicas(router, ray_session):
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(6)]
    want = LLM(LLADA_DIR, decoding="low_confidence", num_threads=1).generate(
        prompts, [_params(i) for i in range(6)], use_tqdm=False)

    async def run():
        router.start()
        streams = await asyncio.gather(*(router.submit(Submission(f"r{i}", p, _params(i)))
                                         for i, p in enumerate(prompts)))
        return streams, await asyncio.gather(*(_final(s) for s in streams))
    streams, outs = asyncio.run(run())
    assert sorted(s.replica for s in streams) == [0, 0, 0, 1, 1, 1]    # least loaded
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    counts = router.replica_counts()
    assert [c["served"] for c in counts] == [3, 3] and all(c["in_flight"] == 0 for c in counts)
    stats = ray_session.get([r.actor.stats.remote() for r in router._replicas], timeout=30)
    assert [s["served"] for s in stats] == [3, 3]


def test_dp_bad_request_raises_value_error(router):
    async def run():
        await router.submit(Submission("bad", [10 ** 6], _params(0)))
    with pytest.raises(ValueError, match="outside"):
        asyncio.run(run())
    assert all(c["in_flight"] == 0 for c in router.replica_counts())


def test_dead_replica_fails_its_requests_and_the_other_carries_on(router):
    """Runs last: it kills replica 1 while its request is provably mid-generation."""
    pid = router.infos[1]["pid"]

    async def run():
        # replica 0 holds until both requests are placed (so neither can finish first and the
        # second goes to replica 1); replica 1 may run 12 engine steps, then holds: its
        # 256-token request (one token a step, blocks of 8) has finished its first block and
        # can never finish before the kill
        replicas = [r.actor for r in router._replicas]
        await replicas[0].limit_steps.remote(0)
        await replicas[1].limit_steps.remote(12)
        long = [await router.submit(Submission(f"long{i}", [9, 9, 9], _params(i, 256)))
                for i in range(2)]
        assert [s.replica for s in long] == [0, 1]
        await replicas[0].limit_steps.remote(None)
        first = await long[1].get()
        assert not first.finished and len(first.outputs[0].token_ids) == 8
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ReplicaFailed, match="replica 1 died"):
            await _final(long[1])
        failed_after = time.monotonic() - start
        after = await router.submit(Submission("after", [1, 2, 3], _params(7)))
        return failed_after, await _final(long[0]), after.replica, await _final(after)
    failed_after, survivor, after_replica, after_out = asyncio.run(run())
    assert failed_after < 10.0
    assert survivor.finished and len(survivor.outputs[0].token_ids) == 256
    assert after_replica == 0 and after_out.finished
    counts = router.replica_counts()
    assert router.is_alive and counts[0]["alive"] and router.health() is None
    assert counts[1]["alive"] or counts[1]["restarting"]      # replica 1 is coming back

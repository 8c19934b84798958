"""EngineReplica: one whole Engine inside a Ray actor, stepped by its own thread (data parallelism).

The router (engine/dp_router.py) calls `add_request` / `abort` and long-polls `poll`; the actor is
threaded (Ray `max_concurrency` > 1) so a blocking `poll` never holds up an `add_request`.
Outputs are numbered and stay in the outbox until a later poll acknowledges them (`after`), so
an answer that never reaches the router (a poll whose caller was cancelled) is sent again. One
lock guards the engine: the stepping thread holds it for a step, callers for an add or abort.
If a step raises, every request of this replica fails with the error text (a step is one batch,
so the culprit cannot be told apart) and the replica carries on with new requests, unless its
engine is dead (Engine.check_health raises: a tensor-parallel worker died): then it refuses new
requests and its gauges carry `fatal` (the error), on which the router retires it.
`limit_steps(n)` lets the replica run at most n more engine steps and then hold its requests,
untouched, until `limit_steps(None)`: a drain point for operators, and what lets a test prove a
request is still in flight when it kills the replica.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from cover_vllm.config import EngineConfig
from cover_vllm.engine.engine import Engine
from cover_vllm.outputs import RequestOutput
from cover_vllm.sampling_params import SamplingParams

# one poll result: [(number, request_id, RequestOutput | error text)], and the load gauges
PollResult = tuple[list[tuple[int, str, Any]], dict[str, int]]


class EngineReplica:
    def __init__(self, config: EngineConfig, index: int):
        self.index = index
        self.engine = Engine(config)
        self._cond = threading.Condition()
        self._outbox: list[tuple[int, str, RequestOutput | str]] = []   # not yet acknowledged
        self._sent = 0                     # number of the last output put in the outbox
        self._live: set[str] = set()       # request ids added and not finished / aborted / failed
        self._served = 0                   # requests finished by this replica
        self._stopped = False
        self._steps_left: int | None = None   # steps allowed before holding; None: no limit
        self._fatal: str | None = None     # set once the engine can no longer run forwards
        self._thread = threading.Thread(target=self._run, name=f"dp-replica-{index}",
                                        daemon=True)
        self._thread.start()

    def ready(self) -> dict[str, int]:
        return {"index": self.index, "pid": os.getpid(), "num_pages": self.engine.pool.num_pages}

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        """Raises what Engine.add_request raises (ValueError / TypeError for bad input)."""
        with self._cond:
            if self._fatal is not None:
                raise RuntimeError(self._fatal)
            self.engine.add_request(request_id, prompt, params)
            self._live.add(request_id)
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        with self._cond:
            if request_id in self._live:
                self._live.discard(request_id)
                self.engine.abort_request(request_id)

    def limit_steps(self, steps: int | None) -> None:
        """Run at most `steps` more engine steps, then hold (None lifts the limit)."""
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                                  or steps < 0):
            raise ValueError(f"steps must be an int >= 0 or None, got {steps!r}")
        with self._cond:
            self._steps_left = steps
            self._cond.notify_all()

    def poll(self, timeout_s: float, after: int = 0) -> PollResult:
        """The outputs numbered above `after` (the caller has handled every output up to it,
        and those are dropped), waiting up to `timeout_s` for one, and the load gauges."""
        with self._cond:
            self._outbox = [entry for entry in self._outbox if entry[0] > after]
            self._cond.wait_for(lambda: self._outbox or self._stopped, timeout_s)
            return list(self._outbox), self._gauges()

    def _emit(self, request_id: str, item: RequestOutput | str) -> None:
        self._sent += 1
        self._outbox.append((self._sent, request_id, item))

    def _gauges(self) -> dict[str, int]:
        sched, pool = self.engine.scheduler, self.engine.pool
        return {"running": len(sched.running), "waiting": len(sched.waiting),
                "pages_used": pool.num_used, "pages_total": pool.num_pages,
                "served": self._served, "fatal": self._fatal,
                "held": self._steps_left == 0 and self.engine.has_unfinished_requests()}

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"index": self.index, "pid": os.getpid(), **self._gauges()}

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(30.0)
        self.engine.shutdown()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or (
                    self._steps_left != 0 and self.engine.has_unfinished_requests()))
                if self._stopped:
                    return
                if self._steps_left is not None:
                    self._steps_left -= 1
                self._step()
                self._cond.notify_all()
            time.sleep(0)                  # let a waiting add / abort / poll take the lock

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            error = f"replica {self.index}: engine step failed: {type(exc).__name__}: {exc}"
            for request_id in sorted(self._live):
                self.engine.abort_request(request_id)
                self._emit(request_id, error)
            self._live.clear()
            try:
                self.engine.check_health()
            except Exception as dead:
                self._fatal = f"replica {self.index}: its engine is dead: {dead}"
            return
        for out in outputs:
            if out.request_id not in self._live:
                continue
            self._emit(out.request_id, out)
            if out.finished:
                self._live.discard(out.request_id)
                self._served += 1

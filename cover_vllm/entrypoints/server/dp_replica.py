"""EngineReplica: one whole Engine inside a Ray actor, stepped by its own EngineDriver thread
(engine/driver.py: the same batching and failure rules as the server's engine loop).

The router (dp_router.py) calls `add_request` / `abort` and long-polls `poll`; the actor is
threaded (Ray `max_concurrency` > 1) so a blocking `poll` never holds up an `add_request`.
Outputs are numbered and stay in the outbox until a later poll acknowledges them (`after`), so
an answer that never reaches the router (a poll whose caller was cancelled) is sent again. A
request the driver fails arrives as its error text. Once the engine is dead (a tensor-parallel
worker died) the replica refuses new requests and its gauges carry `fatal` (the reason), on
which the router retires it. `ping` answers the router's liveness probes from a thread of its
own. `limit_steps(n)` holds the replica after n more engine steps (the driver's drain point;
tests use it to keep a request in flight).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from cover_vllm.config import EngineConfig
from cover_vllm.engine.driver import EngineDriver, Submission
from cover_vllm.engine.engine import Engine
from cover_vllm.executor.placement import current_node
from cover_vllm.outputs import RequestOutput
from cover_vllm.sampling_params import SamplingParams

PROBE_GROUP = "probe"     # the Ray concurrency group (one thread) `ping` runs in

# one poll result: [(number, request_id, RequestOutput | error text)], and the load gauges
PollResult = tuple[list[tuple[int, str, Any]], dict[str, int]]


class EngineReplica:
    def __init__(self, config: EngineConfig, index: int):
        self.index = index
        self.engine = Engine(config)
        self._cond = threading.Condition()
        self._outbox: list[tuple[int, str, RequestOutput | str]] = []   # not yet acknowledged
        self._sent = 0                     # number of the last output put in the outbox
        self._served = 0                   # requests finished by this replica
        self._stopped = False
        self.driver = EngineDriver(self.engine, self, name=f"dp-replica-{index}")
        self.driver.start()

    def ready(self) -> dict[str, Any]:
        """Its index, pid, KV pages, Ray node, and where its tensor-parallel ranks run
        (TPExecutor.placement; none at TP=1)."""
        node = current_node()
        return {"index": self.index, "pid": os.getpid(),
                "num_pages": self.engine.load().pages_total,
                "node_id": node and node.node_id, "node_ip": node and node.ip,
                "ranks": list(getattr(self.engine.executor, "placement", []))}

    def ping(self) -> dict[str, float]:
        """The router's liveness probe (its own Ray concurrency group, PROBE_GROUP, so busy
        request threads never delay it): how long the running engine step has run."""
        return {"step_age_s": self.driver.step_age_s()}

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, context_len: int | None = None) -> None:
        """Raises what Engine.add_request raises (ValueError / TypeError for bad input), or
        EngineRequestError / RuntimeError once the engine is dead or the replica stopped.
        `context_len`: a scoring request's split (Submission.context_len)."""
        done, refusal = threading.Event(), []
        self.driver.add(Submission(request_id, list(prompt_token_ids), params, context_len),
                        lambda error: (refusal.append(error), done.set()))
        while not done.wait(1.0):
            problem = self.driver.health()
            if problem is not None and not done.is_set():
                raise RuntimeError(f"replica {self.index}: {problem}")
        if refusal[0] is not None:
            raise refusal[0]

    def abort(self, request_id: str) -> None:
        self.driver.abort(request_id)

    def limit_steps(self, steps: int | None) -> None:
        """Run at most `steps` more engine steps, then hold (None lifts the limit)."""
        self.driver.limit_steps(steps)

    def poll(self, timeout_s: float, after: int = 0) -> PollResult:
        """The outputs numbered above `after` (the caller has handled every output up to it,
        and those are dropped), waiting up to `timeout_s` for one, and the load gauges."""
        with self._cond:
            self._outbox = [entry for entry in self._outbox if entry[0] > after]
            self._cond.wait_for(lambda: self._outbox or self._stopped, timeout_s)
            return list(self._outbox), self._gauges()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"index": self.index, "pid": os.getpid(), **self._gauges()}

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self.driver.stop(30.0)
        self.engine.shutdown()

    def _fatal(self) -> str | None:
        """Why this replica can serve no more (its engine died), else None."""
        try:
            self.engine.check_health()
        except Exception as dead:
            return f"replica {self.index}: its engine is dead: {dead}"
        return None

    def _gauges(self) -> dict[str, int]:
        load = self.driver.load()
        return {"running": load.running, "waiting": load.waiting,
                "pages_used": load.pages_used, "pages_total": load.pages_total,
                "served": self._served, "fatal": self._fatal(), "held": self.driver.held}

    # ---- the driver's sink (its thread) ----------------------------------------------------
    def _emit(self, request_id: str, item: RequestOutput | str) -> None:
        with self._cond:
            self._sent += 1
            self._outbox.append((self._sent, request_id, item))
            self._cond.notify_all()

    def output(self, out: RequestOutput) -> None:
        if out.finished:
            self._served += 1
        self._emit(out.request_id, out)

    def failed(self, request_id: str, error: Exception) -> None:
        self._emit(request_id, f"replica {self.index}: {error}")

    def aborted(self, request_id: str) -> None:
        """Nothing to report: the router forgot the request when it aborted it."""

    def stepped(self) -> None:
        """Gauges are read on demand (`poll`, `stats`)."""

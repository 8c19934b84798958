"""DPRouter: N engine replicas (Ray actors, dp_replica.py) behind one least-loaded router.

Data-parallel serving (`cover-vllm serve --data-parallel-size N`). The router is asyncio-side
and implements the EngineClient protocol (client.py), like the server's engine loop, so the
server can hold either.

A request goes to the live replica with the fewest requests in flight (ties: lowest index) and
stays there. One asyncio task per replica long-polls it for outputs and routes them to the
streams. `stream.get()` raises `error_cls` (pass the server's EngineRequestError) when the
request failed in its replica's step, or when its replica died (noticed by the poll within
`poll_s`) or reported its engine dead (a tensor-parallel worker died); new requests then go to
the surviving replicas. Validation errors of Engine.add_request (ValueError / TypeError) are
raised by `submit` unchanged.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from cover_vllm.config import EngineConfig
from cover_vllm.engine.driver import Submission
from cover_vllm.entrypoints.server.dp_replica import EngineReplica
from cover_vllm.executor.ray_ranks import ensure_ray, ray_module
from cover_vllm.outputs import RequestOutput

READY_TIMEOUT_S = 600.0


class ReplicaStream:
    """One request's outputs (or its error), in arrival order."""

    def __init__(self, submission: Submission, replica: int):
        self.submission, self.replica = submission, replica
        self._queue: asyncio.Queue = asyncio.Queue()

    @property
    def request_id(self) -> str:
        return self.submission.request_id

    def put(self, item: RequestOutput | Exception) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item


@dataclass
class _Replica:
    index: int
    actor: Any
    alive: bool = True
    in_flight: int = 0                 # requests routed here and not finished / aborted
    served: int = 0                    # requests that finished here
    handled: int = 0                   # number of the last output routed (acknowledged next poll)
    gauges: dict[str, int] = field(default_factory=dict)
    task: asyncio.Task | None = None


class DPRouter:
    def __init__(self, config: EngineConfig, data_parallel_size: int, *,
                 error_cls: type[Exception] = RuntimeError, metrics: Any = None,
                 poll_s: float = 0.5):
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or \
                data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got "
                             f"{data_parallel_size!r}")
        ray = ray_module()
        self.config, self.error_cls, self.metrics, self.poll_s = config, error_cls, metrics, poll_s
        self._owns_ray = ensure_ray()
        self._streams: dict[str, ReplicaStream] = {}
        self._stopped = False
        cls = ray.remote(EngineReplica).options(num_cpus=0, max_concurrency=4, max_restarts=0)
        self._replicas = [_Replica(i, cls.remote(config, i)) for i in range(data_parallel_size)]
        try:
            self.infos = ray.get([r.actor.ready.remote() for r in self._replicas],
                                 timeout=READY_TIMEOUT_S)
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"a data-parallel engine replica failed to start: "
                               f"{_brief(exc)}") from None

    # ---- the EngineClient protocol ---------------------------------------------------------
    def start(self) -> None:
        """Start the poll tasks if an event loop runs here (else on the first submit)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._ensure_polling()

    @property
    def is_alive(self) -> bool:
        return not self._stopped and any(r.alive for r in self._replicas)

    def health(self) -> str | None:
        """None when every replica can serve; else why not (a dead replica)."""
        if not self.is_alive:
            return "no data-parallel engine replica is alive"
        dead = [str(r.index) for r in self._replicas if not r.alive]
        if dead:
            return f"data-parallel replica {', '.join(dead)} died (the others still serve)"
        return None

    async def submit(self, submission: Submission) -> ReplicaStream:
        self._ensure_polling()
        live = [r for r in self._replicas if r.alive]
        if self._stopped or not live:
            raise self.error_cls("no data-parallel engine replica is alive")
        replica = min(live, key=lambda r: (r.in_flight, r.index))
        stream = ReplicaStream(submission, replica.index)
        replica.in_flight += 1
        self._streams[stream.request_id] = stream
        try:
            await replica.actor.add_request.remote(
                submission.request_id, list(submission.prompt_token_ids), submission.params,
                submission.context_len)
        except Exception as exc:
            self._forget(stream)
            cause = _cause(exc)
            if isinstance(cause, (ValueError, TypeError)):
                raise cause from None
            raise self.error_cls(f"data-parallel replica {replica.index} refused the request: "
                                 f"{_brief(exc)}") from None
        except BaseException:                                # cancelled: nothing was queued
            self._forget(stream)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        self._forget(stream)
        replica = self._replicas[stream.replica]
        if replica.alive:
            replica.actor.abort.remote(request_id)          # fire and forget
        self._outcome("abort")

    def stop(self, timeout: float = 30.0) -> None:
        """Fail every open stream, stop the replicas and (if this router started it) Ray."""
        if self._stopped:
            return
        self._stopped = True
        ray = ray_module()
        for stream in list(self._streams.values()):
            stream.put(self.error_cls("the server is shutting down"))
        self._streams.clear()
        for r in self._replicas:
            if r.task is not None:
                r.task.cancel()
        stops = [r.actor.shutdown.remote() for r in self._replicas if r.alive]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=timeout)
        for r in self._replicas:
            try:
                ray.kill(r.actor, no_restart=True)
            except Exception:                                # already gone
                pass
            r.alive = False
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    # ---- counters --------------------------------------------------------------------------
    def replica_counts(self) -> list[dict[str, Any]]:
        """Per replica: index, alive, in_flight, served (finished requests), last gauges."""
        return [{"index": r.index, "alive": r.alive, "in_flight": r.in_flight,
                 "served": r.served, **r.gauges} for r in self._replicas]

    # ---- polling ---------------------------------------------------------------------------
    def _ensure_polling(self) -> None:
        for r in self._replicas:
            if r.alive and (r.task is None or r.task.done()):     # none yet, or its loop ended
                r.task = asyncio.get_running_loop().create_task(self._poll(r))

    async def _poll(self, replica: _Replica) -> None:
        ray = ray_module()
        while replica.alive and not self._stopped:
            try:
                items, gauges = await replica.actor.poll.remote(self.poll_s, replica.handled)
            except asyncio.CancelledError:
                raise
            except ray.exceptions.RayActorError as exc:
                self._replica_died(replica, exc)
                return
            replica.gauges = gauges
            for number, request_id, item in items:
                if number > replica.handled:       # a resend of what was routed is skipped
                    self._route(replica, request_id, item)
                    replica.handled = number
            if gauges.get("fatal"):                          # its engine died (a TP worker)
                self._replica_died(replica, RuntimeError(gauges["fatal"]))
                replica.actor.shutdown.remote()              # stop what is left of it
            self._publish()

    def _route(self, replica: _Replica, request_id: str, item: RequestOutput | str) -> None:
        stream = self._streams.get(request_id)
        if stream is None or stream.replica != replica.index:
            return                                           # aborted meanwhile
        if isinstance(item, str):
            self._forget(stream)
            stream.put(self.error_cls(item))
            self._outcome("error")
            return
        stream.put(item)
        if item.finished:
            self._forget(stream)
            replica.served += 1
            if self.metrics is not None:
                self.metrics.on_finished(item)

    def _replica_died(self, replica: _Replica, exc: Exception) -> None:
        replica.alive = False
        error = f"data-parallel replica {replica.index} died: {_brief(exc)}"
        for stream in [s for s in self._streams.values() if s.replica == replica.index]:
            self._forget(stream)
            stream.put(self.error_cls(error))
            self._outcome("error")

    def _forget(self, stream: ReplicaStream) -> None:
        if self._streams.pop(stream.request_id, None) is not None:
            self._replicas[stream.replica].in_flight -= 1

    def _outcome(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.on_outcome(outcome)

    def _publish(self) -> None:
        if self.metrics is None:
            return
        live = [r.gauges for r in self._replicas if r.alive and r.gauges]
        self.metrics.publish(*(sum(g.get(k, 0) for g in live)
                               for k in ("running", "waiting", "pages_used", "pages_total")))


def _cause(exc: BaseException) -> Any:
    """The user-level exception inside a Ray error (RayTaskError.cause), else `exc` itself."""
    return getattr(exc, "cause", None) or exc


def _brief(exc: BaseException, limit: int = 400) -> str:
    """A Ray error's first meaningful lines, not its whole remote traceback."""
    lines = [ln.strip() for ln in str(_cause(exc)).splitlines() if ln.strip()]
    text = " ".join(lines[:3]) or type(exc).__name__
    return text[:limit]

"""DPRouter: N engine replicas (Ray actors, dp_replica.py) behind one least-loaded router that
heals: a dead or unresponsive replica leaves the routing at once and is restarted elsewhere.

Data-parallel serving (`cover-vllm serve --data-parallel-size N`); an EngineClient (client.py)
like the server's engine loop. Rules: dp_supervision.py (routing, health, restarts, nodes,
memory), dp_liveness.py (probes); placement: dp_launch.py (a placement group per replica).

A request goes to the live replica with the fewest requests in flight and stays there. Per
replica one task long-polls it for outputs and one probes it. A replica is taken out when its
actor is gone, its engine reports itself dead (a TP worker died), or dp_liveness's rules say it
is lost (a missed probe deadline: a frozen process or node; a step past the step deadline; a
lasting "temporarily unavailable"). Its requests that have seen no output yet then move to a
live replica (nothing was streamed and their seeds are fixed, so nothing is lost or repeated);
the others fail: `stream.get()` raises `error_cls` (the server's EngineRequestError). It is
rebuilt in the background and rejoins once loaded. The router is `fatal` (the server exits) only
when every replica is dead and none is being restarted. Validation errors of
Engine.add_request (ValueError / TypeError) are raised by `submit` unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from cover_vllm.config import EngineConfig
from cover_vllm.engine.driver import Submission
from cover_vllm.entrypoints.server.dp_launch import ReplicaLauncher
from cover_vllm.entrypoints.server.dp_state import ReplicaSlot, ReplicaStream, awaited
from cover_vllm.entrypoints.server.dp_liveness import Liveness, LivenessPolicy, probe_until_lost
from cover_vllm.entrypoints.server.dp_supervision import (RestartPolicy, fatal_problem,
                                                          health_problem, pick_replica)
from cover_vllm.executor.ray_ranks import ensure_ray, ray_module
from cover_vllm.logger import init_logger
from cover_vllm.outputs import RequestOutput

logger = init_logger(__name__)
READY_TIMEOUT_S = 600.0
SHUTDOWN_TIMEOUT_S = 10.0     # a dead replica that still answers gets this long to stop


class DPRouter:
    def __init__(self, config: EngineConfig, data_parallel_size: int, *,
                 error_cls: type[Exception] = RuntimeError, metrics: Any = None,
                 poll_s: float = 0.5, restart: RestartPolicy = RestartPolicy(),
                 probes: LivenessPolicy = LivenessPolicy()):
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or \
                data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got "
                             f"{data_parallel_size!r}")
        ray = ray_module()
        self.error_cls, self.metrics, self.poll_s = error_cls, metrics, poll_s
        self.restart, self.probes, self.config = restart, probes, config
        self._owns_ray = ensure_ray()
        self._streams: dict[str, ReplicaStream] = {}
        self._tasks: set[asyncio.Task] = set()        # background moves (strong references)
        self._stopped = False
        self._lost_nodes: dict[Any, float] = {}       # node -> when a replica there was lost
        self.launcher = ReplicaLauncher(ray, config)
        self._replicas: list[ReplicaSlot] = []
        try:
            nodes = self.launcher.start_nodes(data_parallel_size)
            together = Counter(nodes)
            for i, node in enumerate(nodes):
                self._replicas.append(ReplicaSlot(i, self.launcher.launch(i, node, (),
                                                                       together[node]),
                                               Liveness(probes, time.monotonic())))
            self.infos = ray.get([r.actor.ready.remote() for r in self._replicas],
                                 timeout=READY_TIMEOUT_S)
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"a data-parallel engine replica failed to start: "
                               f"{_brief(exc)}") from None
        for replica, info in zip(self._replicas, self.infos):
            replica.seen.seen(time.monotonic())
            self.launcher.describe(replica.index, replica.placed, info)

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
        """None while at least one replica serves (the others may be dead or restarting)."""
        if self._stopped:
            return "the server is shutting down"
        return health_problem(self._replicas)

    def fatal(self) -> str | None:
        """Why no replica can ever serve again (all dead, none restarting), else None."""
        return None if self._stopped else fatal_problem(self._replicas)

    async def submit(self, submission: Submission) -> ReplicaStream:
        self._ensure_polling()
        stream = ReplicaStream(submission, -1)
        await self._place(stream)
        return stream

    async def _place(self, stream: ReplicaStream) -> None:
        """Queue `stream`'s request on a live replica; one that refuses it because it is dead
        or dying is skipped for the next (the request never ran there)."""
        sub, tried = stream.submission, set()
        while True:
            replica = None if self._stopped else pick_replica(
                [r for r in self._replicas if r.index not in tried])
            if replica is None:
                raise self.error_cls(self.health() or "no data-parallel replica can take the "
                                     "request (every live one refused it)")
            tried.add(replica.index)
            stream.replica, attempt = replica.index, stream.attempt + 1
            stream.attempt = attempt
            replica.in_flight += 1
            self._streams[stream.request_id] = stream
            actor = replica.actor
            try:      # a replica taken out meanwhile (frozen: no answer ever) moved the request
                await replica.unless_lost(actor.add_request.remote(
                    sub.request_id, list(sub.prompt_token_ids), sub.params, sub.context_len))
                return
            except BaseException as exc:
                if stream.attempt != attempt and isinstance(exc, Exception):
                    return                                   # taken over by a move
                self._forget(stream)
                if not isinstance(exc, Exception):           # cancelled: nothing was queued
                    raise
                cause = _cause(exc)
                if isinstance(cause, (ValueError, TypeError)):
                    raise cause from None
                errors = ray_module().exceptions
                if isinstance(exc, errors.ActorUnavailableError):   # it may come back
                    self._unavailable(replica, actor)
                elif isinstance(exc, errors.RayActorError):
                    self._replica_died(replica, exc, actor)
                logger.warning("data-parallel replica %d refused %s (%s); trying another",
                               replica.index, sub.request_id, _brief(exc))

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
        for task in [*self._tasks, *(t for r in self._replicas
                                     for t in (r.task, r.probe_task, r.restart_task)
                                     if t is not None)]:
            task.cancel()
        stops = [r.actor.shutdown.remote() for r in self._replicas if r.alive]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=timeout)
        for r in self._replicas:
            self.launcher.retire(r.placed)
            r.alive = r.restarting = False
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    # ---- counters --------------------------------------------------------------------------
    def replica_counts(self) -> list[dict[str, Any]]:
        """Per replica, ReplicaSlot.counts."""
        now = time.monotonic()
        return [r.counts(now) for r in self._replicas]

    # ---- polling ---------------------------------------------------------------------------
    def _ensure_polling(self) -> None:
        loop = asyncio.get_running_loop()
        for r in self._replicas:
            if r.alive and (r.task is None or r.task.done()):     # none yet, or its loop ended
                r.task = loop.create_task(self._poll(r))
            if r.alive and (r.probe_task is None or r.probe_task.done()):
                r.probe_task = loop.create_task(self._probe(r))

    async def _poll(self, replica: ReplicaSlot) -> None:
        ray, actor = ray_module(), replica.actor
        while replica.alive and replica.actor is actor and not self._stopped:
            try:
                items, gauges = await actor.poll.remote(self.poll_s, replica.handled)
            except asyncio.CancelledError:
                raise
            except ray.exceptions.ActorUnavailableError:      # a blip: outputs are resent
                if self._unavailable(replica, actor):
                    return
                await asyncio.sleep(self.probes.retry_s)
                continue
            except ray.exceptions.RayActorError as exc:
                self._replica_died(replica, exc, actor)
                return
            replica.seen.seen(time.monotonic())
            replica.gauges = gauges
            for number, request_id, item in items:
                if number > replica.handled:       # a resend of what was routed is skipped
                    self._route(replica, request_id, item)
                    replica.handled = number
            if gauges.get("fatal"):                          # its engine died (a TP worker)
                self._replica_died(replica, RuntimeError(gauges["fatal"]), actor)
            self._publish()

    async def _probe(self, replica: ReplicaSlot) -> None:
        """Probe `replica` until it is lost or dies (cancelled if taken out another way)."""
        actor = replica.actor
        try:
            self._lose(replica, await probe_until_lost(actor, replica.seen), actor)
        except ray_module().exceptions.RayActorError as exc:
            self._replica_died(replica, exc, actor)

    def _unavailable(self, replica: ReplicaSlot, actor: Any) -> bool:
        """Ray said `replica` is temporarily unavailable: True once that has lasted its grace
        (it is then taken out); False: retry."""
        lost = replica.seen.unavailable(time.monotonic())
        if lost is not None:
            self._lose(replica, lost, actor)
        return lost is not None

    def _lose(self, replica: ReplicaSlot, why: str, actor: Any) -> None:
        self._take_out(replica, f"data-parallel replica {replica.index} is lost: {why}", actor,
                       responsive=False)

    def _route(self, replica: ReplicaSlot, request_id: str, item: RequestOutput | str) -> None:
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

    def _replica_died(self, replica: ReplicaSlot, exc: Exception, actor: Any) -> None:
        """`actor` (replica's current actor, else a stale report) is dead: its actor is gone
        (a Ray error), or its engine reported itself dead (the actor may still shut down)."""
        gone = isinstance(exc, ray_module().exceptions.RayActorError)
        self._take_out(replica, f"data-parallel replica {replica.index} died: {_brief(exc)}",
                       actor, responsive=not gone)

    def _take_out(self, replica: ReplicaSlot, error: str, actor: Any, responsive: bool) -> None:
        """`actor` (replica's current actor, else a stale report) is dead or lost (`error`):
        it leaves the routing, its requests move or fail, its node is avoided for a while, and
        its restart is scheduled (`responsive`: it may still answer a shutdown)."""
        if not replica.alive or replica.actor is not actor:
            return
        replica.alive = False
        replica.lose()
        self._lost_nodes[replica.placed.node] = time.monotonic()
        for task in (replica.task, replica.probe_task):   # a frozen replica's calls never end
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        logger.error("%s; %s", error, "restarting it" if not self._stopped else "stopping")
        for stream in [s for s in self._streams.values() if s.replica == replica.index]:
            self._forget(stream)
            stream.attempt += 1                          # a pending placement there is over
            if stream.started or self._stopped:
                stream.put(self.error_cls(error))
                self._outcome("error")
            else:
                self._background(self._move(stream))
        self._publish()
        delay = self.restart.delay_s(replica.attempts)
        if self._stopped:
            return
        if delay is None:
            logger.error("data-parallel replica %d stays dead: its %d restart attempts are "
                         "spent", replica.index, replica.attempts)
            self.launcher.retire(replica.placed)
            return
        replica.restarting = True
        replica.restart_task = asyncio.get_running_loop().create_task(
            self._restart(replica, delay, responsive))

    async def _move(self, stream: ReplicaStream) -> None:
        """Place a request whose replica died before it produced anything on a live one."""
        try:
            await self._place(stream)
        except Exception as exc:
            stream.put(exc if isinstance(exc, self.error_cls) else self.error_cls(str(exc)))
            self._outcome("error")

    async def _restart(self, replica: ReplicaSlot, delay: float, responsive: bool) -> None:
        """Rebuild `replica` after `delay` s, retrying on the policy's backoff, in a new
        placement group on an alive node where no replica was just lost; it rejoins the routing
        once its engine has loaded."""
        if responsive:
            try:
                await asyncio.wait_for(awaited(replica.actor.shutdown.remote()),
                                       SHUTDOWN_TIMEOUT_S)
            except Exception:                                # gone already, or stuck
                pass
        self.launcher.retire(replica.placed)
        while delay is not None and not self._stopped:
            await asyncio.sleep(delay)
            replica.attempts += 1
            placed = None
            others = [r.placed for r in self._replicas if r is not replica and r.alive]
            try:
                placed = await self.launcher.relaunch(
                    replica.index, others, self.restart.quarantined(self._lost_nodes,
                                                                    time.monotonic()))
                info = await asyncio.wait_for(awaited(placed.actor.ready.remote()),
                                              READY_TIMEOUT_S)
            except Exception as exc:
                self.launcher.retire(placed)
                delay = self.restart.delay_s(replica.attempts)
                logger.error("restart %d of data-parallel replica %d failed (%s)%s",
                             replica.attempts, replica.index, _brief(exc),
                             "" if delay is not None else "; it stays dead")
                continue
            except BaseException:                            # cancelled: the router stops
                self.launcher.retire(placed)
                raise
            replica.placed, replica.handled, replica.gauges = placed, 0, {}
            replica.seen = Liveness(self.probes, time.monotonic())
            replica.alive, replica.restarting = True, False
            replica.restarts += 1
            self.infos[replica.index] = info
            logger.warning("data-parallel replica %d is back (restart %d, pid %s)",
                           replica.index, replica.restarts, info.get("pid"))
            self.launcher.describe(replica.index, placed, info)
            self._ensure_polling()
            return
        replica.restarting = False

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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

"""What a DPRouter (dp_router.py) keeps per request and per replica: `ReplicaStream`, one
request's outputs as they arrive, and `ReplicaSlot`, one replica's place, liveness, state and
counters."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from cover_vllm.engine.driver import Submission
from cover_vllm.entrypoints.server.dp_launch import Launched
from cover_vllm.entrypoints.server.dp_liveness import Liveness
from cover_vllm.outputs import RequestOutput


class ReplicaStream:
    """One request's outputs (or its error), in arrival order."""

    def __init__(self, submission: Submission, replica: int):
        self.submission, self.replica = submission, replica
        self.started = False               # an output was routed to it (it cannot move now)
        self.attempt = 0                   # placements so far; a move makes a pending one moot
        self._queue: asyncio.Queue = asyncio.Queue()

    @property
    def request_id(self) -> str:
        return self.submission.request_id

    def put(self, item: RequestOutput | Exception) -> None:
        self.started = True
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item


@dataclass
class ReplicaSlot:
    """One replica as the router tracks it: where it runs, when it last answered, its state and
    counters, and its background tasks."""

    index: int
    placed: Launched                   # its actor, placement group and node (the last launch)
    seen: Liveness                     # when it last answered (dp_liveness.py)
    alive: bool = True
    restarting: bool = False           # dead; a restart is waiting out its backoff or loading
    in_flight: int = 0                 # requests routed here and not finished / aborted
    served: int = 0                    # requests that finished here
    handled: int = 0                   # number of the last output routed (acknowledged next poll)
    attempts: int = 0                  # restart attempts so far (RestartPolicy caps them)
    restarts: int = 0                  # restarts that brought it back
    gauges: dict[str, int] = field(default_factory=dict)
    task: asyncio.Task | None = None   # its poll loop
    probe_task: asyncio.Task | None = None
    restart_task: asyncio.Task | None = None
    waiting: set[asyncio.Future] = field(default_factory=set)   # calls `lose` ends

    @property
    def actor(self) -> Any:
        return self.placed.actor

    async def unless_lost(self, ref: Any) -> Any:
        """The Ray call `ref`'s result (or its error), or None as soon as this replica is taken
        out (`lose`): a frozen replica never answers."""
        gone = asyncio.get_running_loop().create_future()
        self.waiting.add(gone)
        call = asyncio.ensure_future(awaited(ref))
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.waiting.discard(gone)
            if not call.done():
                call.cancel()
        return call.result() if call.done() and not call.cancelled() else None

    def lose(self) -> None:
        """It was taken out: every `unless_lost` waiting on it returns."""
        for gone in self.waiting:
            if not gone.done():
                gone.set_result(None)

    def counts(self, now: float) -> dict[str, Any]:
        """index, alive, restarting, restarts, in_flight, served (finished requests),
        last_seen_s (since it last answered), node_id / node_ip (of its last launch), and
        its last gauges."""
        return {**self.gauges, "index": self.index, "alive": self.alive,
                "restarting": self.restarting, "restarts": self.restarts,
                "in_flight": self.in_flight, "served": self.served,
                "last_seen_s": self.seen.age(now), "node_id": self.placed.node.node_id,
                "node_ip": self.placed.node.ip}


async def awaited(ref: Any) -> Any:
    """A Ray call's result as a coroutine (what asyncio.wait_for and ensure_future take)."""
    return await ref

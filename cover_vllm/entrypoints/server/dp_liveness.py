"""When a data-parallel replica counts as lost although Ray has not said it died: a frozen node,
a hung step, a network that stays down. `Liveness` holds the rules over a clock the caller
passes (tested with a fake one); `probe_until_lost` probes one replica and applies them, for
DPRouter (dp_router.py), which takes a lost replica out.

* Probes: the router calls the replica's `ping` (a thread of its own in the actor) every
  `probe_interval_s`; an answer, or any poll answer, is a sign of life (`last_seen`).
* Probe deadline: a probe unanswered after `probe_deadline_s` means the replica is lost (its
  process or node is frozen, or the network to it is down): it leaves the routing, its
  undelivered requests move, and it is restarted. A frozen node is thus noticed within
  probe_interval_s + probe_deadline_s (7 s by default), where Ray's own node health check takes
  tens of seconds and a frozen process is never noticed.
* Step deadline: a replica that answers but whose engine step has run past `step_deadline_s`
  (a hung device or collective) is lost the same way.
* Transient unavailability: Ray's ActorUnavailableError ("temporarily unavailable": a network
  blip, a connection being re-established) is retried; only when it lasts `unavailable_grace_s`
  does the replica count as lost. Death (ActorDiedError) is final at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, fields
from typing import Any

from cover_vllm.entrypoints.server.dp_replica import PROBE_GROUP
from cover_vllm.executor.ray_ranks import ray_module


@dataclass(frozen=True)
class LivenessPolicy:
    probe_interval_s: float = 2.0
    probe_deadline_s: float = 5.0
    step_deadline_s: float = 60.0
    unavailable_grace_s: float = 5.0
    retry_s: float = 0.5              # the pause before retrying an unavailable replica

    def __post_init__(self):
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"LivenessPolicy.{f.name} must be > 0, got "
                                 f"{getattr(self, f.name)!r}")


class Liveness:
    """One replica's liveness as the router sees it. Each method takes the time now
    (time.monotonic() in the router) and returns None while the replica is alive, else why it
    is lost."""

    def __init__(self, policy: LivenessPolicy, now: float):
        self.policy = policy
        self.last_seen = now
        self._unavailable_since: float | None = None

    def age(self, now: float) -> float:
        """Seconds since the replica last answered."""
        return max(0.0, now - self.last_seen)

    def seen(self, now: float) -> None:
        """It answered (a probe or a poll)."""
        self.last_seen = max(self.last_seen, now)
        self._unavailable_since = None

    def answered(self, now: float, step_age_s: float) -> str | None:
        """A probe's answer: alive, unless its engine step has run past the step deadline."""
        self.seen(now)
        if step_age_s > self.policy.step_deadline_s:
            return (f"its engine step has run for {step_age_s:.1f} s (step deadline "
                    f"{self.policy.step_deadline_s:g} s)")
        return None

    def missed(self, now: float) -> str:
        """A probe went unanswered past its deadline."""
        return (f"it did not answer a liveness probe within {self.policy.probe_deadline_s:g} s "
                f"(last seen {self.age(now):.1f} s ago)")

    def unavailable(self, now: float) -> str | None:
        """Ray said 'temporarily unavailable': None while within the grace (retry after
        `policy.retry_s`), else lost."""
        if self._unavailable_since is None:
            self._unavailable_since = now
        if now - self._unavailable_since >= self.policy.unavailable_grace_s:
            return (f"it stayed unavailable for {now - self._unavailable_since:.1f} s (grace "
                    f"{self.policy.unavailable_grace_s:g} s)")
        return None


async def probe_until_lost(actor: Any, seen: Liveness) -> str:
    """Probe the replica `actor` every probe_interval_s until it is lost; returns why. Raises
    Ray's RayActorError when it died (the caller's to handle); runs until cancelled otherwise."""
    unavailable, policy = ray_module().exceptions.ActorUnavailableError, seen.policy
    while True:
        await asyncio.sleep(policy.probe_interval_s)
        try:
            status = await asyncio.wait_for(_call(actor.ping.options(
                concurrency_group=PROBE_GROUP)), policy.probe_deadline_s)
        except asyncio.TimeoutError:
            return seen.missed(time.monotonic())
        except unavailable:
            lost = seen.unavailable(time.monotonic())
        else:
            lost = seen.answered(time.monotonic(), status["step_age_s"])
        if lost is not None:
            return lost


async def _call(method: Any) -> Any:
    return await method.remote()

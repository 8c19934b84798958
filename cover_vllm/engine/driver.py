"""EngineDriver: the one thread that steps an Engine while requests come and go. The server's
engine loop and every data-parallel replica run one, so both follow the same rules.

The engine is single-threaded, so only the driver's thread touches it. Other threads talk to it
through a command queue (add / abort / limit / stop); what happens to a request is reported to a
`DriverSink` on the driver's thread. Commands are drained between steps: a new request joins the
running batch at the next step (continuous batching) and an abort frees the request's KV pages
before the next step.

Failure rule: a step is one batched forward over every running request, so an exception cannot
be pinned on one request directly. The failed batch is aborted and replayed in halves
(bisection) while new arrivals wait; a request that fails alone gets the error, every other one
finishes normally. Replays are exact (a request's tokens never depend on its batch, and callers
fix every seed at arrival) and consumers skip text they have already seen. An engine that can no
longer run forwards (Engine.check_health raises: a tensor-parallel worker died) is not bisected:
every request fails with its error at once, new ones are refused, and `health()` reports it.

`limit_steps(n)` lets the driver run at most n more engine steps and then hold its requests,
untouched, until `limit_steps(None)`: a drain point for operators, and what lets a test prove a
request is still in flight.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

from cover_vllm.engine.engine import Engine, EngineLoad
from cover_vllm.outputs import RequestOutput
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.scoring.params import LoglikelihoodParams

logger = logging.getLogger(__name__)


class EngineRequestError(Exception):
    """The engine failed on this request; the driver and the other requests carry on."""


@dataclass
class Submission:
    """One request as a client hands it to an engine (the server fixes its seed). A scoring
    request (params: LoglikelihoodParams) scores prompt_token_ids[context_len:] given the rest."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | LoglikelihoodParams
    context_len: int | None = None

    def engine_prompt(self) -> dict:
        """The prompt as Engine.add_request takes it."""
        if self.context_len is None:
            return {"prompt_token_ids": self.prompt_token_ids}
        return {"context_token_ids": self.prompt_token_ids[:self.context_len],
                "continuation_token_ids": self.prompt_token_ids[self.context_len:]}


class DriverSink(Protocol):
    """Where a driver reports, on its own thread."""

    def output(self, out: RequestOutput) -> None:
        """A partial or finished output of a live request."""

    def failed(self, request_id: str, error: Exception) -> None:
        """The request failed (EngineRequestError); nothing more comes for it."""

    def aborted(self, request_id: str) -> None:
        """An abort found the request (live or waiting out a replay) and dropped it."""

    def stepped(self) -> None:
        """An iteration of the loop ended (a place to publish gauges)."""


Accept = Callable[[Exception | None], None]   # None: queued; else why it was refused


class EngineDriver:
    def __init__(self, engine: Engine, sink: DriverSink, name: str = "cover-vllm-engine"):
        self.engine, self.sink, self.name = engine, sink, name
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # driver-thread state
        self._live: dict[str, Submission] = {}                  # added to the engine
        self._held: deque[Submission] = deque()                 # accepted, waiting out a replay
        self._groups: deque[list[Submission]] = deque()         # suspect groups still to replay
        self._replaying = False                                 # a suspect group is running
        self._steps_left: int | None = None                     # None: no step limit
        self._step_started: float | None = None                 # monotonic; None between steps
        self.num_failed_steps = 0

    # ---- any thread ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._commands.put(("stop", None))
            self._thread.join(timeout)

    def health(self) -> str | None:
        """None while requests can be served, else why not."""
        if self._thread is None or not self._thread.is_alive():
            return "the engine loop is not running"
        try:
            self.engine.check_health()           # reads a flag; safe from any thread
        except Exception as exc:
            return f"the engine is dead: {_what(exc)}"
        return None

    def add(self, submission: Submission, accept: Accept) -> None:
        """Queue a request; `accept` is called on the driver's thread with None, or with what
        Engine.add_request raised (bad input) or why the driver refuses it."""
        self._commands.put(("add", (submission, accept)))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def limit_steps(self, steps: int | None) -> None:
        """Run at most `steps` more engine steps, then hold (None lifts the limit)."""
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                                  or steps < 0):
            raise ValueError(f"steps must be an int >= 0 or None, got {steps!r}")
        self._commands.put(("limit", steps))

    def step_age_s(self) -> float:
        """How long the engine step now running has run (0 between steps): a data-parallel
        router's step deadline reads it."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def held(self) -> bool:
        """The step limit is reached with requests in the engine."""
        return self._steps_left == 0 and self.engine.has_unfinished_requests()

    def load(self) -> EngineLoad:
        """The engine's load; requests waiting out a replay count as waiting."""
        load = self.engine.load()
        pending = len(self._held) + sum(len(g) for g in self._groups)
        return EngineLoad(load.running, load.waiting + pending, load.pages_used,
                          load.pages_total)

    # ---- driver thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain(block=not self._can_step()):
                try:
                    self._iteration()
                except Exception:                       # keep serving whatever happened
                    logger.exception("%s: loop iteration failed", self.name)
        finally:
            self._shutdown()

    def _can_step(self) -> bool:
        return self._steps_left != 0 and self.engine.has_unfinished_requests()

    def _iteration(self) -> None:
        if self._can_step():
            if self._steps_left is not None:
                self._steps_left -= 1
            self._step()
        if not self.engine.has_unfinished_requests() and (
                self._replaying or self._groups or self._held):
            self._next_group()
        self.sink.stepped()

    def _drain(self, block: bool) -> bool:
        """Run queued commands; False once asked to stop."""
        try:
            command, arg = self._commands.get() if block else self._commands.get_nowait()
            while command != "stop":
                try:
                    self._command(command, arg)
                except Exception:                       # never let one command kill the loop
                    logger.exception("%s: %s failed", self.name, command)
                command, arg = self._commands.get_nowait()
        except queue.Empty:
            return True
        return False

    def _command(self, command: str, arg) -> None:
        if command == "add":
            self._add(*arg)
        elif command == "abort":
            self._abort(arg)
        else:
            self._steps_left = arg

    def _add(self, sub: Submission, accept: Accept) -> None:
        problem = self.health()
        if problem is not None:
            accept(EngineRequestError(problem))
            return
        try:
            self._engine_add(sub)
        except Exception as exc:                        # bad input: refuse this request only
            accept(exc)
            return
        if self._replaying or self._groups:
            self.engine.abort_request(sub.request_id)   # validated; joins after the replay
            del self._live[sub.request_id]
            self._held.append(sub)
        accept(None)

    def _engine_add(self, sub: Submission) -> None:
        self.engine.add_request(sub.request_id, sub.engine_prompt(), sub.params)
        self._live[sub.request_id] = sub

    def _abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
        else:
            found = [(q, s) for q in (self._held, *self._groups) for s in q
                     if s.request_id == request_id]
            if not found:
                return                                  # already finished
            for q, s in found:
                q.remove(s)
        self.sink.aborted(request_id)

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as exc:
            dead = self.health() is not None     # then no request is to blame: fail them all
            (self._fail_all if dead else self._isolate)(exc)
            return
        finally:
            self._step_started = None
        for out in outputs:
            if out.request_id not in self._live:
                continue
            if out.finished:
                del self._live[out.request_id]
            self.sink.output(out)

    def _isolate(self, exc: Exception) -> None:
        """A step raised: abort its batch and replay it in halves; a lone request fails."""
        self.num_failed_steps += 1
        logger.warning("%s: engine step failed (%s: %s); replaying its batch in halves",
                       self.name, type(exc).__name__, exc)
        in_batch = set(self.engine.running_request_ids())
        subs = self._abort_live()
        suspects = [s for s in subs if s.request_id in in_batch] or subs
        self._held.extendleft(reversed([s for s in subs if s not in suspects]))
        if len(suspects) == 1:
            self._fail(suspects[0], exc)
        elif suspects:
            half = len(suspects) // 2
            self._groups.extendleft([suspects[half:], suspects[:half]])
        self._replaying = False

    def _next_group(self) -> None:
        """The engine is empty: load the next suspect group, or release the held requests."""
        if self._groups:
            self._replaying = True
            for sub in self._groups.popleft():
                self._readd(sub)
            return
        self._replaying = False
        while self._held:
            self._readd(self._held.popleft())

    def _readd(self, sub: Submission) -> None:
        try:
            self._engine_add(sub)
        except Exception as exc:
            self._fail(sub, exc)

    def _fail_all(self, exc: Exception) -> None:
        logger.error("%s: the engine died (%s); failing every request", self.name, _what(exc))
        subs = [*self._abort_live(), *self._held, *(s for g in self._groups for s in g)]
        self._held.clear(), self._groups.clear()
        self._replaying = False
        for sub in subs:
            self._fail(sub, exc)

    def _abort_live(self) -> list[Submission]:
        """Abort every request in the engine; their submissions."""
        subs = list(self._live.values())
        for rid in list(self._live):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("%s: abort of %s failed", self.name, rid)
        self._live.clear()
        return subs

    def _fail(self, sub: Submission, exc: Exception) -> None:
        self.sink.failed(sub.request_id, EngineRequestError(
            f"the engine failed on this request: {_what(exc)}"))

    def _shutdown(self) -> None:
        error = EngineRequestError("the server is shutting down")
        for rid in self._live:
            self.engine.abort_request(rid)
        for sub in [*self._live.values(), *self._held, *(s for g in self._groups for s in g)]:
            self.sink.failed(sub.request_id, error)
        self._live.clear(), self._held.clear(), self._groups.clear()
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                arg[1](error)


def _what(exc: Exception) -> str:
    """`Type: message` of an engine error; an ExecutorError's reason without its advice to
    offline users (rebuild the LLM), which does not apply to a server."""
    return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"

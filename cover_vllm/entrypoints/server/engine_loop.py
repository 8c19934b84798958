"""EngineLoop: the one thread that drives Engine.step() while server requests come and go.

The engine is single-threaded, so only this thread touches it. The event loop talks to it
through a command queue (add / abort / stop) and receives RequestOutputs on per-request asyncio
queues. Commands are drained between steps: a new request joins the running batch at the next
step (continuous batching) and an abort frees the request's KV pages before the next step.

Failure isolation: a step is one batched forward over every running request, so an exception
cannot be pinned on one request directly. The failed batch is aborted and replayed in halves
(bisection) while new arrivals wait; a request that fails alone gets the error, every other one
finishes normally. Replays are exact (a request's tokens never depend on its batch, and the
server fixes every seed at arrival) and the consumer skips text it has already streamed.
An engine that can no longer run forwards (Engine.check_health raises: a tensor-parallel worker
died) is not bisected: every request fails with its error at once, new ones are refused, and
`health()` reports it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass

from cover_vllm.engine.engine import Engine
from cover_vllm.entrypoints.server.metrics import ServerMetrics
from cover_vllm.outputs import RequestOutput
from cover_vllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineRequestError(Exception):
    """The engine failed on this request; the loop and the other requests carry on."""


@dataclass
class Submission:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class RequestStream:
    """The async side of one request: its outputs (or an error) arrive on an asyncio.Queue."""

    def __init__(self, submission: Submission, loop: asyncio.AbstractEventLoop):
        self.submission = submission
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()
        self.accepted.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def request_id(self) -> str:
        return self.submission.request_id

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:              # the event loop is closed: nobody is listening
            pass

    def accept(self, error: Exception | None) -> None:
        """Engine thread: the request was queued (None) or refused (the exception)."""
        def settle() -> None:
            if not self.accepted.done():
                if error is None:
                    self.accepted.set_result(None)
                else:
                    self.accepted.set_exception(error)
        self._call(settle)

    def put(self, item: RequestOutput | Exception) -> None:
        self._call(self._queue.put_nowait, item)

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None):
        self.engine, self.metrics = engine, metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # engine-thread state
        self._live: dict[str, RequestStream] = {}              # added to the engine
        self._held: deque[RequestStream] = deque()             # accepted, waiting out a replay
        self._groups: deque[list[RequestStream]] = deque()     # suspect groups still to replay
        self._replaying = False                                # a suspect group is in the engine
        self.num_failed_steps = 0

    # ---- event-loop side -------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cover-vllm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._commands.put(("stop", None))
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self.health() is None

    def health(self) -> str | None:
        """None while requests can be served, else why not."""
        if self._thread is None or not self._thread.is_alive():
            return "the engine loop is not running"
        try:
            self.engine.check_health()           # reads a flag; safe from the event loop
        except Exception as exc:
            return f"the engine is dead: {type(exc).__name__}: {exc}"
        return None

    async def submit(self, submission: Submission) -> RequestStream:
        """Queue a request; raises what Engine.add_request raised (bad input) if refused."""
        problem = self.health()
        if problem is not None:
            raise EngineRequestError(problem)
        stream = RequestStream(submission, asyncio.get_running_loop())
        self._commands.put(("add", stream))
        try:
            await asyncio.shield(stream.accepted)
        except asyncio.CancelledError:
            self.abort(submission.request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished_requests()):
                try:
                    self._iteration()
                except Exception:                       # keep serving whatever happened
                    logger.exception("engine loop iteration failed")
        finally:
            self._shutdown()

    def _iteration(self) -> None:
        if self.engine.has_unfinished_requests():
            self._step()
        if not self.engine.has_unfinished_requests() and (
                self._replaying or self._groups or self._held):
            self._next_group()
        self._publish()

    def _drain(self, block: bool) -> bool:
        """Run queued commands; False once asked to stop."""
        try:
            command, arg = self._commands.get() if block else self._commands.get_nowait()
            while command != "stop":
                try:
                    (self._add if command == "add" else self._abort)(arg)
                except Exception:                       # never let one command kill the loop
                    logger.exception("engine loop: %s failed", command)
                command, arg = self._commands.get_nowait()
        except queue.Empty:
            return True
        return False

    def _add(self, stream: RequestStream) -> None:
        sub = stream.submission
        try:
            self.engine.add_request(sub.request_id, {"prompt_token_ids": sub.prompt_token_ids},
                                    sub.params)
        except Exception as exc:                        # bad input: refuse this request only
            stream.accept(exc)
            return
        if self._replaying or self._groups:
            self.engine.abort_request(sub.request_id)   # validated; joins after the replay
            self._held.append(stream)
        else:
            self._live[sub.request_id] = stream
        stream.accept(None)

    def _abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
        else:
            pending = [self._held, *self._groups]
            found = [(q, s) for q in pending for s in q if s.request_id == request_id]
            if not found:
                return                                  # already finished
            for q, s in found:
                q.remove(s)
        if self.metrics is not None:
            self.metrics.on_outcome("abort")

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            dead = self.health() is not None     # then no request is to blame: fail them all
            (self._fail_all if dead else self._isolate)(exc)
            return
        for out in outputs:
            stream = self._live.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._live[out.request_id]
                if self.metrics is not None:
                    self.metrics.on_finished(out)
            stream.put(out)

    def _isolate(self, exc: Exception) -> None:
        """A step raised: abort its batch and replay it in halves; a lone request fails."""
        self.num_failed_steps += 1
        logger.warning("engine step failed (%s: %s); replaying its batch in halves",
                       type(exc).__name__, exc)
        in_batch = {r.request_id for r in self.engine.scheduler.running}
        streams = self._abort_live()
        suspects = [s for s in streams if s.request_id in in_batch] or streams
        self._held.extendleft(reversed([s for s in streams if s not in suspects]))
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
            for stream in self._groups.popleft():
                self._readd(stream)
            return
        self._replaying = False
        while self._held:
            self._readd(self._held.popleft())

    def _readd(self, stream: RequestStream) -> None:
        sub = stream.submission
        try:
            self.engine.add_request(sub.request_id, {"prompt_token_ids": sub.prompt_token_ids},
                                    sub.params)
        except Exception as exc:
            self._fail(stream, exc)
            return
        self._live[sub.request_id] = stream

    def _fail_all(self, exc: Exception) -> None:
        logger.error("the engine died (%s: %s); failing every request", type(exc).__name__, exc)
        streams = [*self._abort_live(), *self._held, *(s for g in self._groups for s in g)]
        self._held.clear(), self._groups.clear()
        self._replaying = False
        for stream in streams:
            self._fail(stream, exc)

    def _abort_live(self) -> list[RequestStream]:
        """Abort every request in the engine; their streams."""
        streams = list(self._live.values())
        for rid in list(self._live):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("engine loop: abort of %s failed", rid)
        self._live.clear()
        return streams

    def _fail(self, stream: RequestStream, exc: Exception) -> None:
        stream.put(EngineRequestError(f"the engine failed on this request: "
                                      f"{type(exc).__name__}: {exc}"))
        if self.metrics is not None:
            self.metrics.on_outcome("error")

    def _publish(self) -> None:
        if self.metrics is None:
            return
        sched, pool = self.engine.scheduler, self.engine.pool
        waiting = len(sched.waiting) + len(self._held) + sum(len(g) for g in self._groups)
        self.metrics.publish(len(sched.running), waiting, pool.num_used, pool.num_pages)

    def _shutdown(self) -> None:
        error = EngineRequestError("the server is shutting down")
        for rid, stream in list(self._live.items()):
            self.engine.abort_request(rid)
            stream.put(error)
        for stream in [*self._held, *(s for g in self._groups for s in g)]:
            stream.put(error)
        self._live.clear(), self._held.clear(), self._groups.clear()
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                arg.accept(error)

"""EngineLoop: the server's EngineClient over one local Engine, stepped by an EngineDriver thread
(engine/driver.py: continuous batching, failure bisection, the dead-engine rule).

The event loop submits requests and receives their RequestOutputs (or an EngineRequestError)
on per-request asyncio queues (`RequestStream`); the driver's thread hands them over with
`call_soon_threadsafe`. A dead engine (a tensor-parallel worker died) or a dead driver thread is
`fatal`: one engine cannot heal, so the server exits and its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import time

from cover_vllm.engine.driver import EngineDriver, EngineRequestError, Submission
from cover_vllm.engine.engine import Engine
from cover_vllm.entrypoints.server.metrics import ServerMetrics
from cover_vllm.outputs import RequestOutput

__all__ = ["EngineLoop", "EngineRequestError", "RequestStream", "Submission"]


class RequestStream:
    """The async side of one request: its outputs (or an error) arrive on an asyncio.Queue.
    `put` may be called from any thread."""

    def __init__(self, submission: Submission, loop: asyncio.AbstractEventLoop):
        self.submission = submission
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None    # its first output with generated tokens

    @property
    def request_id(self) -> str:
        return self.submission.request_id

    def put(self, item: RequestOutput | Exception) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:              # the event loop is closed: nobody is listening
            pass

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item


class EngineLoop:
    """start / stop / health / submit / abort over one Engine (the EngineClient protocol)."""

    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None):
        self.engine, self.metrics = engine, metrics
        if metrics is not None:
            metrics.set_kv_cache_bytes(engine.memory.page_bytes, engine.memory.scratch_bytes)
        self.driver = EngineDriver(engine, self)
        self._streams: dict[str, RequestStream] = {}
        self._started = self._stopping = False

    @property
    def num_failed_steps(self) -> int:
        return self.driver.num_failed_steps

    def start(self) -> None:
        self.driver.start()
        self._started = True
        self.stepped()                     # the gauges (KV pages in the pool) from the start

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the driver (it fails what it holds); any stream still open then fails too."""
        self._stopping = True
        self.driver.stop(timeout)
        for stream in list(self._streams.values()):
            stream.put(EngineRequestError("the server is shutting down"))
        self._streams.clear()

    def health(self) -> str | None:
        """None while requests can be served, else why not."""
        return self.driver.health()

    def fatal(self) -> str | None:
        """Why the engine can never serve again (it died, or its loop did), else None."""
        if not self._started or self._stopping:
            return None
        return self.driver.health()

    async def submit(self, submission: Submission) -> RequestStream:
        """Queue a request; raises what Engine.add_request raised (bad input) if refused."""
        problem = self.health()
        if problem is not None:
            raise EngineRequestError(problem)
        loop = asyncio.get_running_loop()
        stream = RequestStream(submission, loop)
        accepted = loop.create_future()
        accepted.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._streams[submission.request_id] = stream
        self.driver.add(submission, lambda error: _settle(loop, accepted, error))
        try:
            await asyncio.shield(accepted)
        except asyncio.CancelledError:
            self.abort(submission.request_id)
            raise
        except BaseException:
            self._streams.pop(submission.request_id, None)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self.driver.abort(request_id)

    # ---- the driver's sink (its thread) ----------------------------------------------------
    def output(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if stream.first_token_at is None and isinstance(out, RequestOutput) and (
                out.finished or any(c.token_ids for c in out.outputs)):
            stream.first_token_at = time.monotonic()
            if self.metrics is not None:
                self.metrics.on_first_token(stream.first_token_at - stream.submitted_at)
        if out.finished:
            del self._streams[out.request_id]
            if self.metrics is not None:
                self.metrics.on_finished(out)
        stream.put(out)

    def failed(self, request_id: str, error: Exception) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(error)
        if self.metrics is not None:
            self.metrics.on_outcome("error")

    def aborted(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self.metrics is not None:
            self.metrics.on_outcome("abort")

    def stepped(self) -> None:
        if self.metrics is not None:
            load = self.driver.load()
            self.metrics.publish(load.running, load.waiting, load.pages_used, load.pages_total)


def _settle(loop: asyncio.AbstractEventLoop, accepted: asyncio.Future,
            error: Exception | None) -> None:
    """Driver thread: resolve the submit's future on the event loop."""
    def settle() -> None:
        if not accepted.done():
            if error is None:
                accepted.set_result(None)
            else:
                accepted.set_exception(error)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:                  # the event loop is closed
        pass

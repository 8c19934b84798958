"""EngineClient: what the server's routes need from an engine, however it runs.

Two implementations: EngineLoop (one local Engine stepped by an EngineDriver thread) and DPRouter
(replicas in Ray actors, each with its own driver). A route submits a Submission (its seed fixed
by the server) and reads the stream; abort frees the request wherever it runs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from cover_vllm.engine.driver import Submission
from cover_vllm.outputs import RequestOutput


class ResultStream(Protocol):
    """One request's outputs in order; `get` raises EngineRequestError if it failed."""

    @property
    def request_id(self) -> str: ...

    async def get(self) -> RequestOutput: ...


@runtime_checkable
class EngineClient(Protocol):
    def start(self) -> None:
        """Begin serving (called once the event loop runs)."""

    def stop(self, timeout: float = 30.0) -> None:
        """Fail what is still open and release the engines."""

    def health(self) -> str | None:
        """None while requests can be served, else why not."""

    def fatal(self) -> str | None:
        """Why this client can never serve again (its engine died, or every replica did and
        none is coming back), else None. The server exits on it (app.py's watchdog)."""

    async def submit(self, submission: Submission) -> ResultStream:
        """Queue a request; raises ValueError / TypeError for bad input, EngineRequestError
        when no engine can take it."""

    def abort(self, request_id: str) -> None:
        """Drop the request (no-op once it finished)."""

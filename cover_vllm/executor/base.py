"""What every executor offers the engine, the errors it raises, and the remote-ranks contract.

An executor runs one SchedulerOutput through the model and returns the driver's
ModelRunnerOutput. The single-process `Worker` is one; `TPExecutor` (tp_executor.py) drives
tensor-parallel ranks 1..N-1 through a `RemoteRanks` transport: processes with pipes
(mp_ranks.py) or Ray actors (ray_ranks.py).
"""

from __future__ import annotations

from typing import Any, Protocol

from cover_vllm.config import EngineConfig
from cover_vllm.scheduler.output import SchedulerOutput


REBUILD_ADVICE = "In-flight requests cannot finish; create a new LLM/engine."
# the remote ranks' lock-step forwards: each answers None or its traceback (remote.py)
STEP_METHODS = ("execute_model", "run_pieces")


class ExecutorError(RuntimeError):
    """The executor can no longer run forwards; every in-flight request fails with this and the
    engine must be rebuilt (a new LLM). `reason` is what happened; the message adds `advice`
    (for offline users: the server, which exits instead, reports only the reason)."""

    def __init__(self, reason: str, advice: str | None = None):
        super().__init__(reason, advice)
        self.reason, self.advice = reason, advice

    def __str__(self) -> str:
        return f"{self.reason}. {self.advice}" if self.advice else self.reason


class WorkerDiedError(ExecutorError):
    """A tensor-parallel worker process died or failed; its message names the rank and pid."""


class RemoteRankError(Exception):
    """One remote rank failed a call: `died` when its process is gone, else `detail` holds its
    traceback (or says it timed out)."""

    def __init__(self, rank: int, detail: str, died: bool = False, pid: int | None = None):
        self.rank, self.detail, self.died, self.pid = rank, detail, died, pid
        super().__init__(self.describe())

    def describe(self) -> str:
        who = f"rank {self.rank}" + (f" (pid {self.pid})" if self.pid is not None else "")
        return f"{who} died: {self.detail}" if self.died else f"{who} failed: {self.detail}"


class Executor(Protocol):
    """What the engine calls (cover_vllm.worker.Worker and TPExecutor implement it)."""

    model: Any                     # the driver's (rank 0) model; a shard under tensor parallelism

    @property
    def num_pages(self) -> int: ...

    def execute_model(self, out: SchedulerOutput) -> Any: ...     # -> ModelRunnerOutput

    def run_pieces(self, cache: Any, pieces: list) -> Any: ...    # Nemotron's forward: logits

    def draft_adapter(self, model_dir: Any) -> Any: ...           # its LoRA, on every rank

    def check_health(self) -> None: ...                           # raises ExecutorError if dead

    def peak_memory_bytes(self) -> list[int]: ...                 # VmHWM per rank, driver first

    def shutdown(self) -> None: ...                               # idempotent


class RemoteRanks(Protocol):
    """Ranks 1..N-1 of one tensor-parallel group, each a `ShardWorker` (remote.py)."""

    host: str                      # the address the driver's rendezvous store listens on

    def start(self, config: EngineConfig, world_size: int) -> None:
        """Begin building every remote rank (non-blocking: the driver loads its shard meanwhile)."""

    def call(self, method: str, *args: Any) -> Any:
        """Send `method(*args)` to every remote rank; returns a handle for `wait`."""

    def wait(self, pending: Any, timeout_s: float) -> list[Any]:
        """Each rank's result, in rank order; raises RemoteRankError for the first that failed,
        died or did not answer within `timeout_s`."""

    def diagnose(self, pending: Any, grace_s: float) -> list[RemoteRankError]:
        """After a failed step: which ranks died or raised (waiting at most `grace_s`)."""

    def pids(self) -> list[int]: ...

    def shutdown(self) -> None:
        """Stop every remote rank and release what start() acquired; idempotent."""

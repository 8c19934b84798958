"""TPExecutor: one tensor-parallel group; rank 0 (the driver) runs in the engine process.

Each step the driver sends the SchedulerOutput to ranks 1..N-1 (a control message through the
RemoteRanks transport; page tables the ranks already hold are left out, executor/step_delta.py), runs its own shard of the same forward — the row-parallel all-reduces
through torch.distributed keep the ranks in lock-step — then collects the ranks' empty replies.
Only the driver's logits are used: the strategy runs once, in the engine process, and its
decision reaches the ranks inside the next SchedulerOutput.

Nemotron's decodings (engine/nemotron_runner.py) step the same way through `run_pieces`: the
driver keeps every slot's bookkeeping and sends each forward as a `PiecesCall` (the pieces with
their lengths and page ids), which a rank runs statelessly over its own KV shard (#50).

Failure handling: any error in a step (a dead rank closes its sockets, so the driver's pending
all-reduce fails at once; a hung rank trips the collective or reply timeout) is diagnosed
(which rank, its pid, exit code or traceback), every remote rank is stopped, and the executor
turns dead: this step and every later call raise the same `WorkerDiedError` / `ExecutorError`.

Once the group has formed, `placement` says where each remote rank runs (pid, Ray node, the
address its group sockets use), and a Ray rank's is logged, one line per rank.
"""

from __future__ import annotations

import weakref

from cover_vllm.config import EngineConfig
from cover_vllm.distributed.comm import GroupComm
from cover_vllm.distributed.tensor_parallel import TensorParallel, check_tensor_parallel
from cover_vllm.executor.base import (REBUILD_ADVICE, ExecutorError, RemoteRankError,
                                      RemoteRanks, WorkerDiedError)
from cover_vllm.executor.placement import NodeInfo
from cover_vllm.executor.step_delta import StepEncoder
from cover_vllm.logger import init_logger
from cover_vllm.models.builtin import ResolvedModel, local_config
from cover_vllm.models.loader import build_model
from cover_vllm.models.nemotron_cache import pieces_call
from cover_vllm.models.spec import ModelSpec
from cover_vllm.scheduler.output import SchedulerOutput
from cover_vllm.step_plan import ModelRunnerOutput
from cover_vllm.worker.worker import Worker

logger = init_logger(__name__)
STARTUP_TIMEOUT_S = 600.0     # loading a large checkpoint on every rank can take minutes
DIAGNOSE_GRACE_S = 5.0        # how long a failed step waits to learn which rank went away


class TPExecutor:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel, spec: ModelSpec,
                 ranks: RemoteRanks):
        world = config.tensor_parallel_size
        check_tensor_parallel(build_model(spec, device="meta"), world)   # before any process
        self.world_size, self.timeout_s = world, config.distributed_timeout_s
        self.ranks = ranks
        self.steps = StepEncoder()
        self._error: ExecutorError | None = None
        self._closed = False
        self.comm = GroupComm(0, world, config.device, self.timeout_s)
        self._finalizer = weakref.finalize(self, _stop, ranks, self.comm)   # also at exit
        try:
            # ranks load their shards while the driver does, from the directories the driver
            # resolved (a hub id was downloaded once, here)
            ranks.start(local_config(config, resolved), world)
            self.driver = Worker(config, resolved, spec, TensorParallel(0, world, self.comm))
            infos = self._startup(ranks.call("info"), "start")
            ranks.pids = [info["pid"] for info in infos]
            pages = {info["num_pages"] for info in infos} | {self.driver.num_pages}
            if len(pages) != 1:
                raise ExecutorError(f"tensor-parallel ranks sized different KV pools: {pages}")
            port = self.comm.serve_store(ranks.host)
            pending = ranks.call("connect", ranks.host, port)
            self.comm.connect(ranks.host, port)
            addresses = self._startup(pending, "join the process group", self.timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.placement = [{"rank": rank, "pid": info["pid"], "node_id": info.get("node_id"),
                           "node_ip": info.get("node_ip"), "address": address}
                          for rank, (info, address) in enumerate(zip(infos, addresses), 1)]
        for where in self.placement:
            if where["node_id"] is not None:              # a Ray actor: say which node
                logger.info("%s", describe_rank(where))

    def _startup(self, pending, what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> list:
        try:
            return self.ranks.wait(pending, timeout_s)
        except RemoteRankError as err:
            raise RuntimeError(f"tensor-parallel worker failed to {what}: "
                               f"{err.describe()}") from None

    @property
    def model(self):
        """The driver's model (rank 0's shard: local head counts in `model.dims`)."""
        return self.driver.model

    @property
    def num_pages(self) -> int:
        return self.driver.num_pages

    @property
    def cache(self):
        """The driver's KV cache (rank 0's kv heads); every rank's pool has the same pages."""
        return self.driver.cache

    def peak_memory_bytes(self) -> list[int]:
        """Peak resident memory (VmHWM) of every rank's process, rank 0 (this one) first."""
        self.check_health()
        remote = self.ranks.wait(self.ranks.call("peak_memory"), self.timeout_s)
        return [*self.driver.peak_memory_bytes(), *remote]

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self._lockstep("execute_model", self.steps.encode(out),
                              lambda: self.driver.execute_model(out))

    def run_pieces(self, cache, pieces: list):
        """Nemotron's batched forward (models/nemotron_cache.py) on every rank; the driver's
        logits. `cache`: the runner's PagedSlots (pages of the engine's pool) or a scratch
        cache its pieces neither read nor write."""
        return self._lockstep("run_pieces", pieces_call(cache, pieces),
                              lambda: self.driver.run_pieces(cache, pieces))

    def draft_adapter(self, model_dir):
        """Load the checkpoint's LoRA draft adapter on every rank, each its shard; the
        driver's (None when the checkpoint has none)."""
        self.check_health()
        adapter = self.driver.draft_adapter(model_dir)     # a bad adapter: ValueError, here
        if adapter is not None:
            try:
                self.ranks.wait(self.ranks.call("draft_adapter", model_dir), self.timeout_s)
            except Exception as exc:
                raise self._fail(exc, None) from exc
        return adapter

    def _lockstep(self, method: str, message, run_driver):
        """Send `message` to the remote ranks' `method`, run the driver's share meanwhile (the
        all-reduces keep them in step), wait for the ranks; the driver's result."""
        self.check_health()
        pending = None
        try:
            pending = self.ranks.call(method, message)
            result = run_driver()
            self.ranks.wait(pending, self.timeout_s)
        except Exception as exc:
            raise self._fail(exc, pending) from exc
        return result

    def _fail(self, exc: Exception, pending) -> ExecutorError:
        culprits = [exc] if isinstance(exc, RemoteRankError) else []
        if not culprits and pending is not None:
            culprits = self.ranks.diagnose(pending, DIAGNOSE_GRACE_S)
        if culprits:
            what = "; ".join(c.describe() for c in culprits)
            died = any(c.died for c in culprits)
            cls = WorkerDiedError if died else ExecutorError
            err = cls(f"tensor-parallel worker {what}", REBUILD_ADVICE)
        else:       # the driver raised, or a rank hangs (the collective timed out)
            err = ExecutorError(f"tensor-parallel step failed: {type(exc).__name__}: {exc} "
                                f"(no remote rank reported a failure within "
                                f"{DIAGNOSE_GRACE_S:g} s; rank pids {self.ranks.pids})",
                                REBUILD_ADVICE)
        self._error = err
        self.shutdown()
        return err

    def check_health(self) -> None:
        """Raise the error that killed this executor (or ExecutorError after shutdown)."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ExecutorError("the tensor-parallel executor was shut down")

    def shutdown(self) -> None:
        """Stop every remote rank and close the process group; idempotent."""
        self._closed = True
        self._finalizer()


def describe_rank(where: dict) -> str:
    """One log line for a remote rank: its pid, node and gloo address."""
    node = NodeInfo(where["node_id"], where["node_ip"]) if where.get("node_id") else "this host"
    return (f"tensor-parallel rank {where['rank']} (pid {where['pid']}) on {node}, "
            f"group address {where['address']}")


def _stop(ranks: RemoteRanks, comm: GroupComm) -> None:
    ranks.shutdown()
    comm.close()

"""ShardWorker: a non-driver tensor-parallel rank (1..N-1), in a Ray actor or an mp process.

It builds its shard of the model and KV cache, joins the driver's process group, and runs every
forward it is sent; its outputs are dropped (the driver's rank holds the same logits), so only
an error string ever travels back. A rank whose forward raises has left the collectives out of
step: it returns its traceback and exits shortly after, which closes its sockets so the driver's
pending all-reduce fails at once instead of waiting for the timeout.

`mp_worker_main` is the process body for the "mp" backend, started as
`python -m cover_vllm.executor.remote FD` on one end of a socket pair (a fresh interpreter: the
user's `__main__` is never re-imported, and no forked torch thread pools): the first message is
(config, rank, world_size), then (method, args) requests arrive pickled and ("ok", result) /
("error", traceback) replies go back.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from cover_vllm.config import EngineConfig
from cover_vllm.distributed.comm import GroupComm
from cover_vllm.distributed.tensor_parallel import TensorParallel
from cover_vllm.executor.placement import current_node
from cover_vllm.executor.step_delta import StepDecoder
from cover_vllm.models.builtin import resolve_model
from cover_vllm.models.nemotron_cache import PiecesCall, run_call
from cover_vllm.models.spec import ModelSpec
from cover_vllm.scheduler.output import SchedulerOutput

EXIT_DELAY_S = 0.2      # a failed rank lingers this long so its reply can leave first


class ShardWorker:
    def __init__(self, config: EngineConfig, rank: int, world_size: int):
        from cover_vllm.worker.worker import Worker

        resolved = resolve_model(config.model)       # a local directory (local_config)
        spec = ModelSpec.from_config(resolved.config).with_max_model_len(config.max_model_len)
        self.rank, self.page_size = rank, config.page_size
        self.comm = GroupComm(rank, world_size, config.device, config.distributed_timeout_s)
        self.worker = Worker(config, resolved, spec, TensorParallel(rank, world_size, self.comm))
        self.steps = StepDecoder()

    def info(self) -> dict[str, Any]:
        """pid, KV pages, and the Ray node this rank runs on (None for an "mp" process)."""
        node = current_node()
        return {"pid": os.getpid(), "num_pages": self.worker.num_pages,
                "node_id": node and node.node_id, "node_ip": node and node.ip}

    def peak_memory(self) -> int:
        """This rank's peak resident memory (VmHWM) in bytes."""
        from cover_vllm.worker.memory import peak_rss_bytes

        return peak_rss_bytes()

    def connect(self, host: str, port: int) -> str:
        """Join the driver's group (its store at `host`:`port`); returns this rank's address."""
        return self.comm.connect(host, port)

    def execute_model(self, message: SchedulerOutput) -> str | None:
        """Run the step the driver encoded (executor/step_delta.py). None on success; else the
        traceback, and this process exits EXIT_DELAY_S later."""
        return _step(lambda: self.worker.execute_model(self.steps.decode(message)))

    def run_pieces(self, call: PiecesCall) -> str | None:
        """Run this rank's share of one of Nemotron's batched forwards (#50) over its own KV
        shard; like `execute_model`, None or the traceback (and the process exits)."""
        return _step(lambda: run_call(self.worker.model, self.worker.cache,
                                      self.page_size, call))

    def draft_adapter(self, model_dir) -> None:
        """Load this rank's shard of the checkpoint's LoRA draft adapter (nothing collective)."""
        self.worker.draft_adapter(model_dir)

    def close(self) -> None:
        self.comm.close()


def _step(run) -> str | None:
    """Run one lock-step forward: None, or its traceback with this process exiting
    EXIT_DELAY_S later (its collectives are out of step; the exit fails the driver's at once)."""
    try:
        run()
        return None
    except BaseException:
        threading.Timer(EXIT_DELAY_S, os._exit, args=(1,)).start()
        return traceback.format_exc()


def mp_worker_main(conn: Connection, config: EngineConfig, rank: int, world_size: int) -> None:
    """Body of an "mp" rank process. Ends on "shutdown", or when the driver's end of the pipe
    closes (the engine process is gone), so a rank never outlives its driver."""
    try:
        worker = ShardWorker(config, rank, world_size)
    except BaseException:
        conn.send(("error", f"start-up failed:\n{traceback.format_exc()}"))
        return
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if method == "shutdown":
            break
        try:
            reply: tuple[str, Any] = ("ok", getattr(worker, method)(*args))
        except BaseException:
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            break
    worker.close()


def main(argv: list[str]) -> None:
    conn = Connection(int(argv[1]))
    try:
        config, rank, world_size = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    mp_worker_main(conn, config, rank, world_size)


if __name__ == "__main__":
    main(sys.argv)

"""GroupComm: the torch.distributed process group joining the tensor-parallel ranks of one engine.

Built from a `TCPStore` and a backend object directly (gloo on CPU, NCCL on CUDA), never through
`init_process_group`, so no process-global default group exists: two engines in one process
(or a test that builds several) never collide. Rank 0 (the driver, in the engine process) hosts
the store on a port the OS picks (port 0), so there is no hard-coded or pre-probed port.

Every collective waits at most `timeout_s`; a peer process that dies closes its sockets and the
waiting collective fails at once ("Connection closed by peer"), which the executor turns into a
`WorkerDiedError`.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class GroupComm:
    """One rank's handle on the group; `connect` must be called on every rank before a forward."""

    def __init__(self, rank: int, world_size: int, device: str = "cpu", timeout_s: float = 60.0):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.backend = "nccl" if str(device).startswith("cuda") else "gloo"
        self._store: dist.TCPStore | None = None
        self._pg = None

    # ---- set-up ----------------------------------------------------------------------------
    def serve_store(self, host: str) -> int:
        """Rank 0: start the rendezvous store on a free port of `host`; returns the port."""
        assert self.rank == 0, "only rank 0 hosts the store"
        self._store = dist.TCPStore(host, 0, self.world_size, True, _timedelta(self.timeout_s),
                                    wait_for_workers=False)
        return self._store.port

    def connect(self, host: str, port: int) -> None:
        """Join the group (blocks until every rank has joined, at most `timeout_s`)."""
        if self._store is None:
            self._store = dist.TCPStore(host, port, self.world_size, False,
                                        _timedelta(self.timeout_s))
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _timedelta(self.timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self._pg = dist.ProcessGroupGloo(self._store, self.rank, self.world_size, opts)
        else:                                                     # pragma: no cover (GPU only)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _timedelta(self.timeout_s)
            self._pg = dist.ProcessGroupNCCL(self._store, self.rank, self.world_size, opts)

    @property
    def connected(self) -> bool:
        return self._pg is not None

    # ---- collectives -----------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over the ranks; returns `tensor`."""
        if self.world_size == 1:
            return tensor
        if self._pg is None:
            raise RuntimeError(f"rank {self.rank}: collective before the group was connected")
        self._pg.allreduce([tensor]).wait()
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place elementwise max over the ranks; returns `tensor` (W8A8's row-parallel
        activation scales: layers/quantization/w8a8_kernels.py)."""
        if self.world_size == 1:
            return tensor
        if self._pg is None:
            raise RuntimeError(f"rank {self.rank}: collective before the group was connected")
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._pg.allreduce([tensor], opts).wait()
        return tensor

    def close(self) -> None:
        """Drop the group and the store (closes this rank's sockets)."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:      # already broken by a dead peer: dropping it is enough
                pass

"""GroupComm: the torch.distributed process group joining the tensor-parallel ranks of one engine.

Built from a `TCPStore` and a backend object directly (gloo on CPU, NCCL on CUDA), never through
`init_process_group`, so no process-global default group exists: two engines in one process
(or a test that builds several) never collide. Rank 0 (the driver, in the engine process) hosts
the store on a port the OS picks (port 0), so there is no hard-coded or pre-probed port.

Between hosts: every rank reaches the store at rank 0's address, and creates its gloo device on
its *own* address (`local_address`: COVER_VLLM_HOST_IP when set, else the source address of
this host's route to rank 0), or on the interface GLOO_SOCKET_IFNAME names. NCCL exchanges its
ids through the same store and picks its interfaces itself (NCCL_SOCKET_IFNAME).

Every collective waits at most `timeout_s`; a peer process that dies closes its sockets and the
waiting collective fails at once ("Connection closed by peer"), which the executor turns into a
`WorkerDiedError`.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

HOST_IP_ENV = "COVER_VLLM_HOST_IP"       # this process's address for the group, when set
IFNAME_ENV = "GLOO_SOCKET_IFNAME"        # or the interface of its gloo device (torch's name)
_DISCARD_PORT = 9                        # any port: a UDP connect() sends nothing


def own_address(default: str) -> str:
    """This process's address as its peers reach it: COVER_VLLM_HOST_IP, else `default`."""
    return os.environ.get(HOST_IP_ENV) or default


def local_address(peer: str) -> str:
    """The address this process uses to reach `peer` (rank 0): COVER_VLLM_HOST_IP when set,
    else the source address of this host's route to `peer`, the interface the peer's packets
    come back through (a UDP socket's connect() picks the route and sends nothing), else the
    host name's address, else loopback."""
    if os.environ.get(HOST_IP_ENV):
        return os.environ[HOST_IP_ENV]
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((peer, _DISCARD_PORT))
            return probe.getsockname()[0]
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def gloo_device(address: str):
    """A gloo device on the interface GLOO_SOCKET_IFNAME names, else on `address` (which must
    be this host's)."""
    if os.environ.get(IFNAME_ENV):
        return dist.ProcessGroupGloo.create_device(interface=os.environ[IFNAME_ENV])
    return dist.ProcessGroupGloo.create_device(hostname=address)


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class GroupComm:
    """One rank's handle on the group; `connect` must be called on every rank before a forward."""

    def __init__(self, rank: int, world_size: int, device: str = "cpu", timeout_s: float = 60.0):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.backend = "nccl" if str(device).startswith("cuda") else "gloo"
        self._store: dist.TCPStore | None = None
        self._pg = None
        self.address: str | None = None     # where this rank's gloo device listens

    # ---- set-up ----------------------------------------------------------------------------
    def serve_store(self, host: str) -> int:
        """Rank 0: start the rendezvous store on a free port of `host`; returns the port."""
        assert self.rank == 0, "only rank 0 hosts the store"
        self._store = dist.TCPStore(host, 0, self.world_size, True, _timedelta(self.timeout_s),
                                    wait_for_workers=False)
        return self._store.port

    def connect(self, host: str, port: int) -> str:
        """Join the group whose store rank 0 serves at `host`:`port` (blocks until every rank has
        joined, at most `timeout_s`); returns this rank's own address (rank 0's is `host`)."""
        if self._store is None:
            self._store = dist.TCPStore(host, port, self.world_size, False,
                                        _timedelta(self.timeout_s))
        self.address = host if self.rank == 0 else local_address(host)
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _timedelta(self.timeout_s)
            opts._devices = [gloo_device(self.address)]
            self._pg = dist.ProcessGroupGloo(self._store, self.rank, self.world_size, opts)
        else:                                                     # pragma: no cover (GPU only)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _timedelta(self.timeout_s)
            self._pg = dist.ProcessGroupNCCL(self._store, self.rank, self.world_size, opts)
        return self.address

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

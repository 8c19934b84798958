"""Capture backends of worker/cuda_graphs.py: how a forward over static buffers is captured once
and replayed. `CudaGraphs` captures it in a `torch.cuda.CUDAGraph`; `Rerun` (CPU, tests) replays
by running the callable again over the same buffers and, with `verify`, fails when a replay's op
sequence differs from the capture's in anything a CUDA graph would have frozen.

A backend's `capture(fn)` returns the replay: a callable that runs the captured work on whatever
the static buffers hold now and returns `fn`'s output tensor (for a CUDA graph, the same tensor
every time, overwritten by the next replay). Neither backend owns the buffers or the keys.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Replay = Callable[[], torch.Tensor]
WARMUP_RUNS = 2     # eager runs on a side stream before a capture (torch.cuda.graph's docs)


class CaptureBackend(Protocol):
    name: str

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        """Capture `fn` (a forward over static buffers, same inputs each call) -> its replay."""


class CudaGraphs:
    """`torch.cuda.CUDAGraph` capture as torch documents it: warm-up runs on a side stream (they
    also build what the forward caches on its first call, e.g. layers/common.py's q/k norm
    weight, so the graph reads the cached tensor), then one capture into a memory pool every graph of this runner shares (graphs never run at the
    same time, and each replay's output is consumed before the next replay). The warm-up runs
    are real forwards: they write the step's K/V to the same slots as the replay does (the same
    values), so they change nothing."""

    name = "cuda"

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.pool = None                    # torch.cuda.graph_pool_handle(), made on first use

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a host thread of the engine touching CUDA meanwhile does not void it
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class Rerun:
    """Replays by running `fn` again (any device): what a CUDA graph would compute, from the
    same static buffers. With `verify`, each run is traced (`OpTrace`) and a replay whose trace
    differs from the capture's raises `GraphMismatch`: an op, shape, scalar argument or input
    buffer a captured graph would have frozen changed from step to step."""

    name = "rerun"

    def __init__(self, verify: bool = True):
        self.verify = verify

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        for _ in range(WARMUP_RUNS):    # as CudaGraphs: what the forward builds lazily on its
            fn()                        # first call (cached weights) is built before the capture
        if not self.verify:
            return fn
        with OpTrace() as captured:
            fn()

        def replay() -> torch.Tensor:
            with OpTrace() as trace:
                out = fn()
            trace.check_against(captured)
            return out

        return replay


class GraphMismatch(AssertionError):
    pass


class OpTrace(TorchDispatchMode):
    """The op sequence of one run, as a CUDA graph freezes it: per op its name and per argument
    either (shape, dtype) of a tensor made earlier in the run, or (shape, dtype, address) of one
    from outside it (weights, cache, static buffers: a graph reads them at that address), a 0-dim
    host tensor's value (a graph bakes it in), or the plain value of a non-tensor argument."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self._made: dict[int, torch.Tensor] = {}    # id -> tensor made in this run (kept alive)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        self.ops.append((str(func), tuple(self._describe(x) for x in leaves)))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._made[id(t)] = t
        return out

    def _describe(self, x):
        if not isinstance(x, torch.Tensor):
            return x if isinstance(x, (int, float, bool, str, type(None))) else repr(x)
        if id(x) in self._made:
            return ("made", tuple(x.shape), x.dtype)
        if x.dim() == 0 and x.device.type == "cpu":
            return ("host scalar", x.item())
        address = x.data_ptr() if x.device.type != "meta" else 0
        return ("outside", tuple(x.shape), x.dtype, address)

    def check_against(self, captured: "OpTrace") -> None:
        if self.ops == captured.ops:
            return
        for i, (got, want) in enumerate(zip(self.ops, captured.ops)):
            if got != want:
                raise GraphMismatch(f"op {i} of the replay differs from the capture:\n"
                                    f"  captured {want}\n  replayed {got}")
        raise GraphMismatch(f"the replay ran {len(self.ops)} ops, the capture "
                            f"{len(captured.ops)}")

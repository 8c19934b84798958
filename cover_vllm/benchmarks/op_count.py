"""Ops per engine step, counted without a GPU (issues #42, #43).

On the meta device (`LLM(..., device="meta", load_format="dummy")`) tensors have shapes and no
values, so what an engine step dispatches splits cleanly:

* a **device op** is an aten op with an output on the model's device: on a GPU, a kernel launch
  (or, for a view, a Python dispatch with no kernel) that the host pays for every step;
* a **host op** is an aten op whose outputs are all on the CPU (or that returns no tensor, such
  as `.item()`): work the host does before or after the forward while the GPU waits. One that
  reads a device tensor is a copy to the host: `StepOps.to_host` records its size (elements).

`OpCounter` is a TorchDispatchMode that sorts every op of a block into those two, by aten name;
`count_steps` runs a batch of requests through a meta engine and counts each step;
`StepOps.per_layer` divides a step's device ops by the model's layers. `scripts/op_count.py`
prints the tables; tests/test_op_count.py holds the engine to its bars.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


@dataclass
class StepOps:
    """The ops counted in one block (an engine step): device and host ops by aten name, and
    the device ops that only alias an input (`views`: no kernel, still a dispatch)."""

    device: Counter = field(default_factory=Counter)   # op name -> device ops
    host: Counter = field(default_factory=Counter)     # op name -> host ops
    views: int = 0
    num_layers: int = 1
    to_host: list = field(default_factory=list)        # elements of each device -> host copy

    @property
    def num_device(self) -> int:
        return sum(self.device.values())

    @property
    def num_host(self) -> int:
        return sum(self.host.values())

    @property
    def per_layer(self) -> float:
        """Device ops of the step per transformer layer (embedding, head and decoder included)."""
        return self.num_device / self.num_layers

    @property
    def ran_model(self) -> bool:
        """Whether the step ran a forward (at least one device op per layer)."""
        return self.num_device >= self.num_layers


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active into a StepOps (`with OpCounter() as ops`
    binds the StepOps)."""

    def __init__(self, num_layers: int = 1):
        super().__init__()
        self.counts = StepOps(num_layers=num_layers)

    def __enter__(self) -> StepOps:
        super().__enter__()
        return self.counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name, counts = func.overloadpacket.__name__, self.counts
        if any(t.device.type != "cpu" for t in _tensors(out)):
            counts.device[name] += 1
            returns = func._schema.returns
            if returns and all(r.alias_info is not None and not r.alias_info.is_write
                               for r in returns):
                counts.views += 1
        else:
            counts.host[name] += 1
            if any(t.device.type != "cpu" for t in _tensors((args, kwargs))):
                counts.to_host.append(sum(t.numel() for t in _tensors(out)))
        return out


def num_layers(llm) -> int:
    """The engine's model's layer count."""
    return int(llm.engine.dims.num_layers)


def count_steps(llm, params, batch: int, prompt_len: int = 64,
                max_steps: int = 10_000) -> list[StepOps]:
    """Add `batch` requests of `prompt_len` tokens with `params`, step the engine until they
    finish and return every step's counts (admission steps included; see `steady`)."""
    engine, layers = llm.engine, num_layers(llm)
    for i in range(batch):
        ids = [5 + (i + j) % 11 for j in range(prompt_len)]
        engine.add_request(f"ops-{batch}-{i}", {"prompt_token_ids": ids}, params)
    steps = []
    while engine.has_unfinished_requests():
        with OpCounter(layers) as ops:
            engine.step()
        steps.append(ops)
        if len(steps) >= max_steps:
            raise RuntimeError(f"the engine did not finish {batch} requests in {max_steps} steps")
    return steps


def steady(steps: list[StepOps]) -> list[StepOps]:
    """The steps that ran the model, without the first (it admits the batch and prefills)."""
    ran = [s for s in steps if s.ran_model]
    return ran[1:] or ran


def summary(steps: list[StepOps]) -> dict:
    """Median and max of the steady steps' device ops per layer and host ops."""
    s = steady(steps)
    return {"steps": len(steps),
            "device_per_layer": statistics.median(x.per_layer for x in s),
            "device_per_layer_max": max(x.per_layer for x in s),
            "views_per_layer": statistics.median(x.views / x.num_layers for x in s),
            "host": statistics.median(x.num_host for x in s),
            "host_max": max(x.num_host for x in s)}

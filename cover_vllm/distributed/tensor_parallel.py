"""Tensor parallelism as a transform over a built model: slice its Linear weights in place.

Megatron-style split of every transformer layer over `world_size` ranks, rank r keeping a
contiguous slice:

* column-parallel (output rows sliced, no communication): q/k/v projections (query heads
  [r·H/N, (r+1)·H/N), kv heads [r·Hkv/N, (r+1)·Hkv/N), so GQA groups stay on one rank) and the
  MLP gate/up projections (`ff_proj`/`up_proj`, `gate_proj`/`up_proj`, every MoE expert's);
* row-parallel (input columns sliced, partial outputs summed by an all-reduce in a forward
  hook): `attn_out`/`o_proj` and `ff_out`/`down_proj`. A row-parallel bias is kept on rank 0
  only (zeroed elsewhere) so the sum adds it once. A sparse MoE block reduces once at its output
  (the router is replicated, so every rank routes identically), not once per expert.

Embeddings, norms, the router and the LM head are replicated: every rank computes the same
(full-vocabulary) logits and only the driver's are used, so no gather is needed. The model's and
each attention module's `dims` become the local ones (H/N heads, Hkv/N kv heads), which is what
sizes the rank's KV cache shard. The attention backend and the COVER override correction are per
head, so they run on a head shard unchanged.

`check_tensor_parallel` raises ValueError (naming `tensor_parallel_size`) when the split is not
even; it runs on a meta-device model before any worker starts. A worker shards its model while
it is still on the meta device (`shard` works on meta and real tensors alike) and asks the
loader for exactly `param_slices` of each checkpoint tensor, so a rank never holds a full copy
of a sharded weight.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from cover_vllm.distributed.comm import GroupComm
from cover_vllm.models.base import ModelDims
from cover_vllm.models.layers import SelfAttention, SwiGLU
from cover_vllm.models.llada import LLaDABlock
from cover_vllm.models.llada_moe import SparseMoE
from cover_vllm.models.safetensors_io import Slice

if TYPE_CHECKING:
    from cover_vllm.worker.model_runner import ModelRunnerOutput


@dataclasses.dataclass
class _Plan:
    column: list[nn.Linear] = dataclasses.field(default_factory=list)
    row: list[tuple[nn.Linear, bool]] = dataclasses.field(default_factory=list)  # (linear, reduce)
    reduce_at: list[nn.Module] = dataclasses.field(default_factory=list)   # all-reduce outputs
    with_dims: list[nn.Module] = dataclasses.field(default_factory=list)   # modules with .dims


def _plan(model: nn.Module) -> _Plan:
    """Which Linear is split which way, from the module types of the three families."""
    plan = _Plan()
    experts = {id(e) for m in model.modules() if isinstance(m, SparseMoE) for e in m.experts}
    for m in model.modules():
        if isinstance(m, LLaDABlock):
            plan.column += [m.q_proj, m.k_proj, m.v_proj, m.ff_proj, m.up_proj]
            plan.row += [(m.attn_out, True), (m.ff_out, True)]
            plan.with_dims.append(m)
        elif isinstance(m, SelfAttention):
            plan.column += [m.q_proj, m.k_proj, m.v_proj]
            plan.row.append((m.o_proj, True))
            plan.with_dims.append(m)
        elif isinstance(m, SwiGLU):
            plan.column += [m.gate_proj, m.up_proj]
            plan.row.append((m.down_proj, id(m) not in experts))
        elif isinstance(m, SparseMoE):
            plan.reduce_at.append(m)
    if not plan.with_dims:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan "
                         "(no LLaDA block or self-attention module found); use "
                         "tensor_parallel_size=1")
    return plan


def check_tensor_parallel(model: nn.Module, world_size: int) -> None:
    """ValueError unless heads, kv heads and every MLP width split evenly over `world_size`."""
    dims: ModelDims = model.dims
    for what, n in (("attention heads", dims.num_heads), ("kv heads", dims.num_kv_heads)):
        if n % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} must divide the number of "
                             f"{what} ({n}) of {type(model).__name__}")
    plan = _plan(model)
    for linear in plan.column:
        if linear.out_features % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} must divide the MLP width "
                             f"{linear.out_features} of {type(model).__name__}")


def param_slices(model: nn.Module, rank: int, world_size: int) -> dict[str, Slice]:
    """What rank `rank` holds of every sharded parameter of the unsharded `model` (meta is
    fine), by name: the loader reads exactly that slice of the checkpoint tensor. Parameters
    not listed are replicated whole."""
    names = {id(m): n for n, m in model.named_modules()}
    plan, out = _plan(model), {}

    def part(n: int, dim: int) -> Slice:
        size = n // world_size
        return Slice(dim, rank * size, size, n)

    for linear in plan.column:
        prefix = names[id(linear)]
        out[f"{prefix}.weight"] = part(linear.out_features, 0)
        if linear.bias is not None:
            out[f"{prefix}.bias"] = part(linear.out_features, 0)
    for linear, _ in plan.row:
        prefix = names[id(linear)]
        out[f"{prefix}.weight"] = part(linear.in_features, 1)
        if linear.bias is not None and rank != 0:
            n = linear.out_features
            out[f"{prefix}.bias"] = Slice(0, 0, n, n, zero=True)
    return out


def _narrow(t: torch.Tensor, dim: int, rank: int, world_size: int) -> nn.Parameter:
    size = t.shape[dim] // world_size
    return nn.Parameter(t.narrow(dim, rank * size, size).clone(), requires_grad=False)


class TensorParallel:
    """Rank `rank` of `world_size`: `shard(model)` once after loading, then `reduce_stats` on
    every forward's output (the drift / attention-mass statistics are means over heads)."""

    def __init__(self, rank: int, world_size: int, comm: GroupComm):
        self.rank, self.world_size, self.comm = rank, world_size, comm

    def _all_reduce_hook(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(output)

    @torch.no_grad()
    def shard(self, model: nn.Module) -> None:
        """Slice `model`'s weights in place to this rank's shard and install the all-reduces."""
        check_tensor_parallel(model, self.world_size)
        rank, n = self.rank, self.world_size
        plan = _plan(model)
        for linear in plan.column:
            linear.weight = _narrow(linear.weight, 0, rank, n)
            if linear.bias is not None:
                linear.bias = _narrow(linear.bias, 0, rank, n)
            linear.out_features = linear.weight.shape[0]
        for linear, reduce in plan.row:
            linear.weight = _narrow(linear.weight, 1, rank, n)
            linear.in_features = linear.weight.shape[1]
            if linear.bias is not None and rank != 0:
                linear.bias.zero_()                   # added once, by rank 0, before the sum
            if reduce:
                linear.register_forward_hook(self._all_reduce_hook)
        for module in plan.reduce_at:
            module.register_forward_hook(self._all_reduce_hook)
        local = dataclasses.replace(model.dims, num_heads=model.dims.num_heads // n,
                                    num_kv_heads=model.dims.num_kv_heads // n)
        for module in [model, *plan.with_dims]:
            module.dims = local

    def reduce_stats(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """Average the per-rank head means of `drift` / `attn_in` into whole-model means (each
        rank holds the same number of heads); one all-reduce for all of them."""
        lists = [lst for lst in (out.drift, out.attn_in) if lst is not None]
        parts = [t for lst in lists for t in lst if t is not None]
        if not parts:
            return out
        flat = self.comm.all_reduce(torch.cat([p.reshape(-1).float() for p in parts]))
        chunks = iter(flat.div_(self.world_size).split([p.numel() for p in parts]))
        for lst in lists:
            for i, t in enumerate(lst):
                if t is not None:
                    lst[i] = next(chunks).view(t.shape).to(t.dtype)
        return out

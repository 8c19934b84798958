"""Tensor parallelism as a transform over a built model: slice its Linear weights in place.

Megatron-style split over `world_size` ranks, rank r keeping a contiguous 1/N of each split
dimension. Which Linear is split which way is declared by the modules themselves: every module
that owns Linear layers may define `parallel_plan() -> ParallelPlan` (layers/base.py) naming its
own Linear attributes; `collect_plan` walks `model.modules()` and gathers them, so this file
knows no model family and tests no module type. A module without a plan is replicated whole.

* `column` (output rows sliced, no communication): q/k/v projections (query heads
  [r·H/N, (r+1)·H/N), kv heads [r·Hkv/N, (r+1)·Hkv/N), so GQA groups stay on one rank) and the
  MLP gate/up projections.
* `column_splits` {name: piece sizes}: one fused column Linear whose rows are pieces side by
  side (LLaDA2's `query_key_value`: q | k | v rows); rank r keeps its 1/N of every piece,
  concatenated, so it holds its own q, k and v heads in the same layout at 1/N the size.
* `row` (input columns sliced, partial outputs summed by an all-reduce in a forward hook):
  attention output and MLP down projections. A row-parallel bias is kept on rank 0 only (zeroed
  elsewhere) so the sum adds it once. Such a Linear gets `reduce_input_amax` (a max
  all-reduce) and `reduce_output` (the sum): a W8A8 kernel quantizes its input slice with the
  whole row's scale and sums the ranks' integer sums itself (then `output_reduced` tells the
  hook to skip): layers/quantization/w8a8_kernels.py.
* `row_unreduced`: row-parallel without the all-reduce; a parent declaring `reduce_output`
  sums once at its own output instead (a sparse MoE block: the router is replicated, so every
  rank routes identically, and its experts' partial outputs are reduced once, not per expert).
* `local_dims`: the module's `dims` become the rank's (H/N heads, Hkv/N kv heads); if any
  module declares it, the model's `dims` do too, which is what sizes the rank's KV cache shard.
* `heads` / `kv_heads` {name: heads}: a column Linear split into whole heads. Query heads must
  split evenly; kv heads split evenly when they can, else, when there are fewer of them than
  ranks and they divide the ranks, rank r keeps a copy of kv head r·Hkv // N, the one its query
  heads read (grouped-query heads are contiguous): the head is replicated, not split.
* `param_splits` {name: (dim, pieces)}: a module's own parameter that is not a Linear (stacked
  MoE experts [E, 2M, H], [E, H, M]) sliced like a column piece split, along `dim`.

Embeddings, norms, routers and the LM head are replicated: every rank computes the same
(full-vocabulary) logits and only the driver's are used, so no gather is needed. The attention
backend and the COVER override correction are per head, so they run on a head shard unchanged.

`check_tensor_parallel` raises ValueError (naming `tensor_parallel_size`) when the split is not
even (heads, kv heads, every split width and every fused piece); it runs on a meta-device model
before any worker starts, and on a model that declares no plan at all. A worker shards its
model while it is still on the meta device (`shard` works on meta and real tensors alike) and
asks the loader for exactly `param_slices` of each checkpoint tensor (several ranges of one
tensor for a fused piece split: `Slice.pieces`), so a rank never holds a full copy of a sharded
weight.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from cover_vllm.distributed.comm import GroupComm
from cover_vllm.layers.base import ModelDims, ParallelPlan
from cover_vllm.layers.base import Slice
from cover_vllm.layers.common import fuse_projections

if TYPE_CHECKING:
    from cover_vllm.step_plan import ModelRunnerOutput


@dataclasses.dataclass
class _Split:
    """One split Linear: `dim` 0 = column (output rows), 1 = row (input columns); `pieces`
    are the sizes along `dim` each sliced 1/N (one piece: the whole width)."""

    name: str                   # qualified module name, e.g. "model.layers.0.self_attn.q_proj"
    linear: nn.Linear
    dim: int
    pieces: tuple[int, ...]
    reduce: bool = False        # row: all-reduce the Linear's output
    heads: int | None = None    # column: whole heads in its output rows (`heads`, `kv_heads`)
    replicable: bool = False    # kv heads: fewer than the ranks -> one copied head per rank


@dataclasses.dataclass
class _ParamSplit:
    """One split parameter that is not a Linear's (`ParallelPlan.param_splits`)."""

    name: str                   # qualified parameter name
    module: nn.Module
    attr: str
    dim: int
    pieces: tuple[int, ...]


@dataclasses.dataclass
class TPPlan:
    """Every module's declared split, gathered over the whole model (`collect_plan`)."""

    splits: list[_Split] = dataclasses.field(default_factory=list)
    params: list[_ParamSplit] = dataclasses.field(default_factory=list)
    reduce_at: list[nn.Module] = dataclasses.field(default_factory=list)   # all-reduce outputs
    with_dims: list[nn.Module] = dataclasses.field(default_factory=list)   # modules with .dims
    declared: int = 0           # modules that declared a plan


def _linear(module: nn.Module, attr: str, where: str) -> nn.Linear:
    linear = getattr(module, attr, None)
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{type(module).__name__} ({where or 'the model'}) declares "
                         f"{attr!r} in its parallel_plan(), which is not an nn.Linear of it")
    return linear


def _module_splits(module: nn.Module, where: str, plan: ParallelPlan) -> list[_Split]:
    def qualified(attr: str) -> str:
        return f"{where}.{attr}" if where else attr

    out = []
    for attr in plan.column:
        if attr not in plan.column_splits:           # listed in both: the pieces win
            lin = _linear(module, attr, where)
            heads = plan.heads.get(attr, plan.kv_heads.get(attr))
            out.append(_Split(qualified(attr), lin, 0, (lin.out_features,), heads=heads,
                              replicable=attr in plan.kv_heads))
    for attr, pieces in plan.column_splits.items():
        lin = _linear(module, attr, where)
        if sum(pieces) != lin.out_features:
            raise ValueError(f"{type(module).__name__} ({where}) declares column_splits "
                             f"{attr}={tuple(pieces)}, which add up to {sum(pieces)}, not its "
                             f"{lin.out_features} output rows")
        out.append(_Split(qualified(attr), lin, 0, tuple(pieces)))
    for attrs, reduce in ((plan.row, True), (plan.row_unreduced, False)):
        for attr in attrs:
            lin = _linear(module, attr, where)
            out.append(_Split(qualified(attr), lin, 1, (lin.in_features,), reduce))
    return out


def collect_plan(model: nn.Module) -> TPPlan:
    """The split every module of `model` declares in `parallel_plan()`; ValueError when none
    declares one (the model cannot be sharded) or a declaration names no Linear of its module."""
    plan = TPPlan()
    seen: set[int] = set()
    for where, module in model.named_modules():
        declare = getattr(module, "parallel_plan", None)
        if not callable(declare):
            continue
        declared: ParallelPlan = declare()
        plan.declared += 1
        for split in _module_splits(module, where, declared):
            if id(split.linear) in seen:
                raise ValueError(f"{split.name} is split by two parallel plans")
            seen.add(id(split.linear))
            plan.splits.append(split)
        for attr, (dim, pieces) in declared.param_splits.items():
            param = getattr(module, attr, None)
            # quantized (layers/stacked_experts.py): the weight is its codes' buffers now, and
            # the declared pieces still say how it was split (a memory plan's param_slices)
            quantized = param is None and getattr(module, "quant_config", None) is not None
            if not quantized and (not isinstance(param, nn.Parameter)
                                  or sum(pieces) != param.shape[dim]):
                raise ValueError(f"{type(module).__name__} ({where}) declares param_splits "
                                 f"{attr}={(dim, pieces)}, which is not one of its parameters "
                                 "or does not add up to its size along that dim")
            plan.params.append(_ParamSplit(f"{where}.{attr}" if where else attr, module, attr,
                                           dim, tuple(pieces)))
        if declared.reduce_output:
            plan.reduce_at.append(module)
        if declared.local_dims:
            plan.with_dims.append(module)
    if not plan.declared:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (no module "
                         "declares parallel_plan()); use tensor_parallel_size=1")
    return plan


def _with_dims(model: nn.Module, plan: TPPlan) -> list[nn.Module]:
    """The modules whose `dims` become the rank's: those declaring `local_dims`, and the model
    itself (its dims size the KV cache) when any does."""
    return list(dict.fromkeys([model, *plan.with_dims])) if plan.with_dims else []


def check_tensor_parallel(model: nn.Module, world_size: int) -> None:
    """ValueError unless heads, kv heads (when attention is split), every split width and
    every fused piece split evenly over `world_size`."""
    plan = collect_plan(model)
    name = type(model).__name__
    for dims in {m.dims for m in _with_dims(model, plan)}:
        for what, n in (("attention heads", dims.num_heads), ("kv heads", dims.num_kv_heads)):
            if n % world_size:
                raise ValueError(f"tensor_parallel_size={world_size} must divide the number "
                                 f"of {what} ({n}) of {name}")
    for split in plan.splits:
        if split.heads is not None:
            h = split.heads
            if h % world_size and not (split.replicable and world_size % h == 0):
                more = " or be a multiple of them" if split.replicable else ""
                raise ValueError(f"tensor_parallel_size={world_size} must divide the {h} heads "
                                 f"of {split.name} of {name}{more}")
            continue
        bad = [p for p in split.pieces if p % world_size]
        if not bad:
            continue
        if len(split.pieces) > 1:
            raise ValueError(f"tensor_parallel_size={world_size} must divide every piece "
                             f"{split.pieces} of the fused {split.name} of {name}")
        kind = "output" if split.dim == 0 else "input"
        raise ValueError(f"tensor_parallel_size={world_size} must divide the {kind} width "
                         f"{bad[0]} of {split.name} of {name} (an MLP or attention width)")
    for ps in plan.params:
        if any(p % world_size for p in ps.pieces):
            raise ValueError(f"tensor_parallel_size={world_size} must divide every piece "
                             f"{ps.pieces} of {ps.name} of {name}")


def _slice(split: _Split, rank: int, world_size: int) -> Slice:
    """Rank `rank`'s ranges of `split` along its dim: its 1/N of every piece, in order (a kv
    head that cannot be split: the rows of the one head rank `rank` reads)."""
    if split.heads is not None and split.heads % world_size:
        full, heads = split.pieces[0], split.heads
        size = full // heads
        return Slice.of_ranges(0, [(rank * heads // world_size * size, size)], full)
    return _pieces_slice(split.dim, split.pieces, rank, world_size)


def _pieces_slice(dim: int, pieces: tuple[int, ...], rank: int, world_size: int) -> Slice:
    ranges, offset = [], 0
    for piece in pieces:
        size = piece // world_size
        ranges.append((offset + rank * size, size))
        offset += piece
    return Slice.of_ranges(dim, ranges, offset)


def param_slices(model: nn.Module, rank: int, world_size: int) -> dict[str, Slice]:
    """What rank `rank` holds of every sharded parameter of the unsharded `model` (meta is
    fine), by name: the loader reads exactly that slice of the checkpoint tensor. Parameters
    not listed are replicated whole."""
    out = {}
    plan = collect_plan(model)
    for ps in plan.params:
        out[ps.name] = _pieces_slice(ps.dim, ps.pieces, rank, world_size)
    for split in plan.splits:
        sl = _slice(split, rank, world_size)
        out[f"{split.name}.weight"] = sl
        bias = split.linear.bias
        if bias is None:
            continue
        if split.dim == 0:
            out[f"{split.name}.bias"] = sl                  # [out]: the same rows
        elif rank != 0:
            n = split.linear.out_features
            out[f"{split.name}.bias"] = Slice(0, 0, n, n, zero=True)
    return out


def _shard_param(t: torch.Tensor, sl: Slice) -> nn.Parameter:
    return nn.Parameter(sl.take(t).clone(), requires_grad=False)


class TensorParallel:
    """Rank `rank` of `world_size`: `shard(model)` once after loading, then `reduce_stats` on
    every forward's output (the drift / attention-mass statistics are means over heads)."""

    def __init__(self, rank: int, world_size: int, comm: GroupComm):
        self.rank, self.world_size, self.comm = rank, world_size, comm

    def _all_reduce_hook(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if getattr(module, "output_reduced", False):      # its kernel summed the ranks' exact
            return output                                 # integer sums (W8A8)
        return self.comm.all_reduce(output)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(t)

    def _all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce_max(t)

    @torch.no_grad()
    def shard(self, model: nn.Module) -> None:
        """Slice `model`'s weights in place to this rank's shard and install the all-reduces;
        projections that run as one GEMM are fused again over the shards (`fuse_projections`;
        nothing to do on meta, where `materialize` fuses them)."""
        check_tensor_parallel(model, self.world_size)
        rank, n = self.rank, self.world_size
        plan = collect_plan(model)
        for split in plan.splits:
            linear, sl = split.linear, _slice(split, rank, n)
            linear.weight = _shard_param(linear.weight, sl)
            if split.dim == 0:
                if linear.bias is not None:
                    linear.bias = _shard_param(linear.bias, sl)
                linear.out_features = linear.weight.shape[0]
                continue
            linear.full_in_features = linear.in_features      # W8A8: its rotation blocks
            linear.in_features = linear.weight.shape[1]
            linear.reduce_input_amax = self._all_reduce_max     # W8A8: TP=1's row scales
            if linear.bias is not None and rank != 0:
                linear.bias.zero_()                   # added once, by rank 0, before the sum
            if split.reduce:
                linear.reduce_output = self._all_reduce         # W8A8: sums its int32 sums
                linear.register_forward_hook(self._all_reduce_hook)
        for ps in plan.params:
            sl = _pieces_slice(ps.dim, ps.pieces, rank, n)
            setattr(ps.module, ps.attr, _shard_param(getattr(ps.module, ps.attr), sl))
        for module in plan.reduce_at:
            module.register_forward_hook(self._all_reduce_hook)
        local: dict[ModelDims, ModelDims] = {}     # one local object per distinct dims
        for module in _with_dims(model, plan):
            dims: ModelDims = module.dims
            if dims not in local:
                local[dims] = dataclasses.replace(dims, num_heads=dims.num_heads // n,
                                                  num_kv_heads=dims.num_kv_heads // n)
            module.dims = local[dims]
        fuse_projections(model)

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

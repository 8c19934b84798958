"""Tensor-parallel plans declared by the modules (layers/base.py `ParallelPlan`), collected by
distributed/tensor_parallel.py without looking at types: a fused column Linear split piece by
piece (LLaDA2's query_key_value), read from a checkpoint range by range (`Slice.pieces`), and a
2-rank forward simulated in one process (row-parallel partial outputs summed by the test)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from cover_vllm.distributed.tensor_parallel import (TensorParallel, check_tensor_parallel,
                                                    collect_plan, param_slices)
from cover_vllm.layers.base import ParallelPlan
from cover_vllm.layers.base import Slice
from cover_vllm.layers.common import FusedLinears, projection_groups
from cover_vllm.models.loader import build_model, load_into, materialize
from cover_vllm.models.safetensors_io import read_header, read_tensor_into
from cover_vllm.models.spec import ModelSpec
from cover_vllm.models.weights import CheckpointWeights, DummyWeights
from golden_cases import GOLDEN

HIDDEN, HEADS, KV_HEADS, D_QK, D_V = 6, 4, 2, 2, 3
PIECES = (HEADS * D_QK, KV_HEADS * D_QK, KV_HEADS * D_V)        # q | k | v rows: 8, 4, 6


class _FusedAttention(nn.Module):
    """Grouped-query attention over a fused `qkv` Linear of three unequal pieces (v heads wider
    than q/k heads); the head counts come from the (possibly sharded) weight's shape."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, sum(PIECES), bias=True)
        self.out = nn.Linear(HEADS * D_V, HIDDEN, bias=True)
        self.group = FusedLinears(self.qkv)

    def fused_groups(self) -> list[FusedLinears]:
        return [self.group]

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(column_splits={"qkv": PIECES}, row=("out",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        share = sum(PIECES) // self.qkv.weight.shape[0]               # world size
        heads, kv = HEADS // share, KV_HEADS // share
        q, k, v = self.group(x).split([heads * D_QK, kv * D_QK, kv * D_V], dim=-1)
        t = x.shape[0]
        q = q.view(t, heads, D_QK).transpose(0, 1)                    # [H, T, d]
        k = k.view(t, kv, D_QK).transpose(0, 1).repeat_interleave(heads // kv, 0)
        v = v.view(t, kv, D_V).transpose(0, 1).repeat_interleave(heads // kv, 0)
        o = F.scaled_dot_product_attention(q, k, v)                   # [H, T, dv]
        return self.out(o.transpose(0, 1).reshape(t, heads * D_V))


class _Toy(nn.Module):
    """The attention plus a Linear without any plan (`head`: replicated)."""

    def __init__(self):
        super().__init__()
        self.attn = _FusedAttention()
        self.head = nn.Linear(HIDDEN, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.attn(x))


class _Identity:
    """A one-process stand-in for GroupComm: the test sums the ranks' partial outputs."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _full_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen)
            for n, p in _Toy().named_parameters()}


def _rank_model(rank: int, source, world: int = 2) -> tuple[nn.Module, dict[str, Slice]]:
    """Rank `rank`'s toy as a worker builds it: sharded on meta, materialized, then filled."""
    with torch.device("meta"):
        model = _Toy()
    slices = param_slices(model, rank, world)
    TensorParallel(rank, world, _Identity()).shard(model)
    materialize(model, "cpu")
    load_into(model, source, slices)
    return model.eval().requires_grad_(False), slices


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-6) -> None:
    """Equal up to fp32 summation order (the row-parallel sum adds the same products in another
    order): max error relative to the tensor's scale (min 1)."""
    err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert err <= tol, f"max error {err:.2e} of the scale > {tol:.0e}"


def _rows_of_rank(full: torch.Tensor, rank: int, world: int = 2) -> torch.Tensor:
    """The rank's rows of every piece, computed independently of Slice."""
    parts, offset = [], 0
    for piece in PIECES:
        size = piece // world
        parts.append(full[offset + rank * size:offset + (rank + 1) * size])
        offset += piece
    return torch.cat(parts)


def test_fused_split_loads_each_ranks_rows_of_every_piece(tmp_path):
    full = _full_state()
    save_file(full, str(tmp_path / "model.safetensors"))
    for rank in range(2):
        model, slices = _rank_model(rank, CheckpointWeights(tmp_path))
        got = dict(model.named_parameters())
        assert slices["attn.qkv.weight"].ranges == tuple(
            (start + rank * (p // 2), p // 2) for start, p in zip((0, 8, 12), PIECES))
        assert torch.equal(got["attn.qkv.weight"], _rows_of_rank(full["attn.qkv.weight"], rank))
        assert torch.equal(got["attn.qkv.bias"], _rows_of_rank(full["attn.qkv.bias"], rank))
        assert torch.equal(got["attn.out.weight"], full["attn.out.weight"][:, rank * 6:][:, :6])
        want_bias = full["attn.out.bias"] if rank == 0 else torch.zeros(HIDDEN)
        assert torch.equal(got["attn.out.bias"], want_bias)
        assert "head.weight" not in slices                   # no plan: replicated whole
        assert torch.equal(got["head.weight"], full["head.weight"])
        assert model.attn.group._fused()                     # the shard runs as one GEMM


def test_sharded_forward_with_a_fused_split_equals_unsharded(tmp_path):
    full = _full_state(seed=1)
    save_file(full, str(tmp_path / "model.safetensors"))
    whole = _Toy()
    whole.load_state_dict(full)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = whole.attn(x)
        ranks = [_rank_model(r, CheckpointWeights(tmp_path))[0] for r in range(2)]
        got = sum(m.attn(x) for m in ranks)                   # the all-reduce of `out`
    _close(got, want)


def test_a_model_already_on_real_tensors_shards_and_fuses_again():
    """`shard` on a materialized, fused model: the fused group is rebuilt over the shards."""
    full = _full_state(seed=4)
    models = []
    for rank in range(2):
        m = materialize(_Toy().to("meta"), "cpu")
        m.load_state_dict(full)
        TensorParallel(rank, 2, _Identity()).shard(m)
        assert all(g._fused() for g in projection_groups(m))
        models.append(m)
    whole = _Toy()
    whole.load_state_dict(full)
    x = torch.randn(3, HIDDEN)
    with torch.no_grad():
        _close(sum(m.attn(x) for m in models), whole.attn(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slice_pieces_read_from_safetensors_on_any_dim_and_dtype(tmp_path, dtype):
    """Several ranges of one tensor, on dim 0 (contiguous reads, or staged on a dtype change)
    and dim 1 (strided, staged whole rows), equal the concatenated narrows."""
    t = torch.randn(10, 12).to(dtype)
    save_file({"w": t}, str(tmp_path / "w.safetensors"))
    info = read_header(tmp_path / "w.safetensors")["w"]
    for dim in (0, 1):
        sl = Slice.of_ranges(dim, [(1, 2), (5, 3), (9, 1)], t.shape[dim])
        for out_dtype in (dtype, torch.float32):
            shape = list(t.shape)
            shape[dim] = sl.size
            dst = torch.empty(shape, dtype=out_dtype)
            with open(tmp_path / "w.safetensors", "rb") as f:
                read_tensor_into(f, info, dst, sl)
            want = torch.cat([t.narrow(dim, s, n) for s, n in ((1, 2), (5, 3), (9, 1))], dim)
            assert torch.equal(dst, want.to(out_dtype)) and torch.equal(sl.take(t), want)


def test_dummy_weights_fill_pieces_with_the_tp1_values():
    shapes = {n: tuple(p.shape) for n, p in _Toy().named_parameters()}
    full = {n: torch.empty(s) for n, s in shapes.items()}
    source = DummyWeights(shapes, seed=7, std=0.5)
    for n, t in full.items():
        source.fill(n, t, None)
    with torch.device("meta"):
        meta = _Toy()
    for rank in range(2):
        for name, sl in param_slices(meta, rank, 2).items():
            if sl.zero:
                continue
            dst = torch.empty(sl.take(full[name]).shape)
            source.fill(name, dst, sl)
            assert torch.equal(dst, sl.take(full[name])), name


def test_slice_rejects_inconsistent_pieces_and_plain_slices_keep_their_fields():
    plain = Slice.of_ranges(0, [(4, 4)], 8)
    assert plain == Slice(0, 4, 4, 8) and plain.ranges == ((4, 4),)
    with pytest.raises(ValueError, match="add up to size"):
        Slice(0, 0, 3, 8, pieces=((0, 2), (4, 2)))
    with pytest.raises(ValueError, match="leave"):
        Slice.of_ranges(0, [(0, 2), (7, 2)], 8)


def test_split_pieces_must_divide_evenly():
    with torch.device("meta"):
        model = _Toy()
    check_tensor_parallel(model, 2)
    for world in (3, 4):                          # 8 % 3, and 6 % 4 (the v piece)
        with pytest.raises(ValueError, match=rf"tensor_parallel_size={world} must divide every "
                                             r"piece \(8, 4, 6\) of the fused attn.qkv"):
            check_tensor_parallel(model, world)


def test_a_model_without_any_plan_is_refused():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(ValueError,
                       match="Plain has no tensor-parallel plan.*tensor_parallel_size=1"):
        check_tensor_parallel(Plain(), 2)
    with pytest.raises(ValueError, match="Plain has no tensor-parallel plan"):
        param_slices(Plain(), 0, 2)


def test_a_plan_naming_no_linear_is_refused():
    class Wrong(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def parallel_plan(self) -> ParallelPlan:
            return ParallelPlan(column=("proj", "nope"))

    with pytest.raises(ValueError, match="'nope' in its parallel_plan"):
        collect_plan(Wrong())


def test_moe_experts_are_split_by_their_declared_plan_and_the_router_is_replicated():
    config = json.loads((GOLDEN / "llada_moe" / "model" / "config.json").read_text())
    meta = build_model(ModelSpec.from_config(config), torch.float32, "meta")
    slices = param_slices(meta, 1, 2)
    plan = collect_plan(meta)
    moe = meta.model.layers[0].mlp
    expert = moe.experts[0]
    assert moe in plan.reduce_at                              # one all-reduce per MoE block
    unreduced = [s for s in plan.splits if s.linear is expert.down_proj]
    assert len(unreduced) == 1 and not unreduced[0].reduce
    assert "model.layers.0.mlp.gate.weight" not in slices     # router: replicated
    inter = expert.gate_proj.out_features
    assert slices["model.layers.0.mlp.experts.0.gate_proj.weight"] == Slice(
        0, inter // 2, inter // 2, inter)
    assert slices["model.layers.0.mlp.experts.0.down_proj.weight"] == Slice(
        1, inter // 2, inter // 2, inter)

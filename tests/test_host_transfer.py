"""The single copies of a step: the host's int64 inputs and metadata to the device in one buffer
(attention/layout.py `move_to`), and the decisions back in one float64 buffer
(host_transfer.py). Both are exercised on the CPU by their packing functions, whose values must
come back bit for bit, and on the meta device for their op counts."""

from __future__ import annotations

import torch

from cover_vllm.attention import build_metadata
from cover_vllm.attention.layout import move_to
from cover_vllm.benchmarks.op_count import OpCounter
from cover_vllm.host_transfer import HostTransfer, _pack_float64, one_buffer, to_device
from test_attention import OVERRIDES, _random_batch


def _mixed(n: int = 3, width: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 126_464, (n, width), generator=gen),          # token ids
            torch.rand(n, width, generator=gen) < 0.5,                     # a mask
            torch.randn(n, width, generator=gen, dtype=torch.float64),     # confidences
            torch.randn(n, 2, generator=gen).to(torch.bfloat16),           # another width
            torch.randint(0, 9, (n,), generator=gen),                      # per-row counts
            torch.randn(n, generator=gen),                                 # fp32 per row
            torch.tensor(7),                                               # a scalar
            torch.randn(2, 2, 2, generator=gen).half(),                    # 3-D, flattened
            torch.randint(0, 3, (4, width), generator=gen)]                # other rows


def test_the_float64_buffer_gives_every_value_back_bit_for_bit():
    tensors = _mixed()
    packed, unpack = _pack_float64(tensors)
    assert packed.dtype == torch.float64 and packed.numel() == sum(t.numel() for t in tensors)
    for got, want in zip(unpack(packed), tensors):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_fetch_is_one_copy_of_few_ops_on_a_device():
    meta = [t.to("meta") for t in _mixed(n=64)]
    transfer = HostTransfer()
    with OpCounter() as ops:
        host = transfer.fetch([meta[0], None, *meta[1:]])
    assert transfer.copies == 1 and host[1] is None
    assert [(t.shape, t.dtype) for t in host if t is not None] == [(t.shape, t.dtype)
                                                                   for t in meta]
    # the buffer, a cat per group of rows (64 and 4 rows here) and one for the rest, their
    # regions' views, and the flattening of what is neither 1-D nor [n, W]
    assert ops.num_device <= 12, ops.device


def test_int64_and_bool_inputs_travel_in_one_buffer():
    bools = [torch.tensor([[True, False, True], [False, False, True]]), torch.ones(5).bool(),
             torch.zeros(0, 2, dtype=torch.bool)]
    tensors = [torch.arange(6).view(2, 3), None, bools[0], torch.tensor([5, 4]), bools[1],
               torch.zeros(0, 4).long(), bools[2]]
    moved = one_buffer(tensors, torch.device("cpu"))
    assert moved[1] is None
    for got, want in zip(moved, tensors):
        if want is not None:
            assert (got.shape, got.dtype) == (want.shape, want.dtype)
            assert torch.equal(got, want)
    with OpCounter() as ops:
        meta = to_device(tensors, torch.device("meta"))
    assert ops.device["_to_copy"] + ops.device["to"] == 1       # one copy; the rest are views
    assert ops.num_device == ops.views + 1, ops.device
    assert [(t.shape, t.dtype) for t in meta if t is not None] == [
        (t.shape, t.dtype) for t in tensors if t is not None]
    assert to_device(tensors, torch.device("cpu"))[0] is tensors[0]    # the CPU: no copy


def test_metadata_moves_in_one_copy_and_keeps_every_field():
    seqs, *_ = _random_batch(4, 2, OVERRIDES, seed=5)
    host = build_metadata(seqs)
    with OpCounter() as ops:
        meta, (ids,) = move_to("meta", host, torch.arange(7))
    assert ops.device["to"] + ops.device["_to_copy"] == 1     # int64 and bool fields together
    assert ids.shape == (7,) and ids.device.type == "meta"
    for name, value in vars(host).items():
        if isinstance(value, torch.Tensor) and not name.startswith("_"):
            moved = getattr(meta, name)
            assert moved.device.type == "meta", name
            assert (moved.shape, moved.dtype) == (value.shape, value.dtype), name
        elif not name.startswith("_"):
            assert getattr(meta, name) == value, name


def test_rope_angles_are_tabulated_off_the_cpu_only():
    from cover_vllm.layers.rotary import ROPE_TABLE_MAX_BYTES, RotaryEmbedding
    cpu = RotaryEmbedding(64, 10000.0)
    cpu.reserve(128)
    assert cpu.table is None                     # the CPU computes its angles every forward
    meta = RotaryEmbedding(64, 10000.0).to("meta")
    meta.reserve(ROPE_TABLE_MAX_BYTES // (2 * 64 * 4) + 1)
    assert meta.table is None                    # too long a table: computed
    meta.reserve(128)
    positions = torch.arange(5, device="meta")
    with OpCounter() as ops:
        rot = meta.at(positions)
    assert ops.num_device == 2 and rot.cos.shape == (5, 1, 64)     # two gathers
    # what the table holds is what `at` computes (the same elementwise ops)
    cos, sin = cpu._angles(torch.arange(128))
    positions = torch.tensor([0, 3, 127, 64, 5])
    want = cpu.at(positions)
    torch.testing.assert_close(cos[positions], want.cos, rtol=0, atol=2e-7)
    torch.testing.assert_close(sin[positions], want.signed_sin, rtol=0, atol=2e-7)

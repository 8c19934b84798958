"""`keys_are_window` (attention/base.py `window_kv`): when every window is its whole canvas, the
backend attends over the fresh K/V instead of gathering them back from the cache it just wrote;
bitwise the gathered path, with K and V side by side (a `LayerKV`) or apart, fp32 and bf16."""

import dataclasses

import pytest
import torch

from cover_vllm.attention import SeqLayout, build_metadata
from cover_vllm.attention.sdpa import SDPABackend
from cover_vllm.layers.kv_layout import LayerKV

H, HKV, D, L = 4, 2, 16, 24


def _layouts(lengths, start=0):
    slots = torch.randperm(128)
    return [SeqLayout(start, n - start, slots[32 * i:32 * i + n], []) for i, n in
            enumerate(lengths)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("joint", [True, False])
def test_window_keys_equal_gathered_keys_bitwise(dtype, joint):
    torch.manual_seed(0)
    meta = build_metadata(_layouts([L, L]))
    assert meta.keys_are_window
    q = torch.randn(2 * L, H, D, dtype=dtype)
    kv = torch.randn(2 * L, 2 * HKV, D, dtype=dtype)
    outs = []
    for fast in (True, False):
        cache = torch.zeros(128, 2 * HKV, D, dtype=dtype)
        pair = LayerKV(cache) if joint else tuple(cache.split(HKV, dim=1))
        k, v = (kv, None) if joint else kv.split(HKV, dim=1)
        m = dataclasses.replace(meta, keys_are_window=fast)
        outs.append((SDPABackend().forward(q, k, v, pair, m), cache))
    assert torch.equal(outs[0][0], outs[1][0])          # the same attention output
    assert torch.equal(outs[0][1], outs[1][1])          # and the same cache written


def test_only_whole_canvases_take_the_window_keys():
    assert not build_metadata(_layouts([L, L - 4])).keys_are_window      # lengths differ
    assert not build_metadata(_layouts([L, L], start=8)).keys_are_window  # a partial window
    seqs = _layouts([L])
    seqs[0].override = [(3, 3)]
    assert not build_metadata(seqs).keys_are_window                      # an override

"""One layer's K/V as the attention reads it: K and V side by side in one tensor (`LayerKV`),
and the views and gathers that hand SDPA its [B, H, K, d] layout without copies (issue #42).
Shared by the engine's backends (attention/), the KV cache (worker/kv_cache.py) and
Nemotron's piece attention (models/nemotron_cache.py)."""

from __future__ import annotations

import torch


class LayerKV(tuple):
    """One layer's (k_cache, v_cache) [slots, Hkv, d]: the two halves of `joint` [slots,
    2 Hkv, d] (K heads, then V heads), so that one op writes both and one gather reads both
    (attention/base.py)."""

    joint: torch.Tensor

    def __new__(cls, joint: torch.Tensor) -> "LayerKV":
        pair = super().__new__(cls, joint.split(joint.shape[1] // 2, dim=1))
        pair.joint = joint
        return pair



def heads_first(x: torch.Tensor, b: int, n: int, heads: int | None = None,
                offset: int = 0) -> torch.Tensor:
    """x [b * n, H, d] (any strides) seen as [b, H, n, d], the layout SDPA reads, without a
    copy: one `as_strided` where a view and a transpose would dispatch two ops (each a launch
    overhead on a GPU; issue #42). `heads` < H reads only that many heads from `offset`
    (elements): the K or the V half of x [b * n, 2 Hkv, d] (`gather_kv`)."""
    row, head, col = x.stride()
    return x.as_strided((b, heads or x.shape[1], n, x.shape[2]), (n * row, head, row, col),
                        x.storage_offset() + offset)


def gather_heads(pool: torch.Tensor, slots: torch.Tensor,
                 flat: torch.Tensor | None = None) -> torch.Tensor:
    """pool [slots, H, d] at slots [B, K] -> [B, H, K, d], SDPA's layout (index_select: ~1.6x
    faster on CPU than 2-D advanced indexing); `flat`: the slots already flattened [B * K]."""
    flat = slots.reshape(-1) if flat is None else flat
    return heads_first(pool.index_select(0, flat), *slots.shape)


def gather_kv(cache, slots: torch.Tensor,
              flat: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values at slots [B, K], each [B, Hkv, K, d]: the layout SDPA reads. A cache
    whose K and V share one tensor (`joint` [slots, 2 Hkv, d], worker/kv_cache.py) is read by
    one gather and seen as the two halves (three ops; four for two tensors)."""
    flat = slots.reshape(-1) if flat is None else flat
    b, k = slots.shape
    joint = getattr(cache, "joint", None)
    if joint is not None:
        both = joint.index_select(0, flat)                                 # [B * K, 2 Hkv, d]
        heads = both.shape[1] // 2
        return (heads_first(both, b, k, heads),
                heads_first(both, b, k, heads, offset=heads * both.stride(1)))
    return tuple(gather_heads(c, slots, flat) for c in cache)


def window_kv(kv: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None,
              shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values [B, Hkv, K, d] when they are the window's own fresh K/V in canvas
    order (`AttentionMetadata.keys_are_window`, shape = [B, K]): views of side-by-side `kv`
    [B * K, 2 Hkv, d], or of `k` and `v` [B * K, Hkv, d]; the values `gather_kv` would read
    back from the cache just written, without the gather."""
    b, n = shape
    if kv is not None:
        heads = kv.shape[1] // 2
        return (heads_first(kv, b, n, heads),
                heads_first(kv, b, n, heads, offset=heads * kv.stride(1)))
    return heads_first(k, b, n), heads_first(v, b, n)

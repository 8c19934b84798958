"""KVCache: the per-layer K and V tensors of the paged pool, addressed by slot = page * size + i;
and KVLayout: how a model's K/V are laid out, which sizes the pool (worker/memory.py).

Most models have one K/V shape for every layer, all paged. DiffusionGemma's layers differ (its
full-attention layers have their own head size and kv heads) and its sliding-window layers only
ever read the last window - 1 positions before what they encode or denoise, so they keep each
running sequence in a **ring** of `ring_len` slots (slot = ring start + position mod ring_len)
instead of pages: ring_len = window - 1 + the longest chunk the encoder writes at once
(`encode_chunk`: the canvas, or a prompt piece). The pools themselves are the model's
(`model.allocate_kv`: full layers `num_pages * page_size` slots, sliding ones `num_rings *
ring_len`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cover_vllm.layers.base import ModelDims
from cover_vllm.layers.kv_layout import LayerKV
from cover_vllm.models.gemma4_config import SLIDING

MIN_ENCODE_CHUNK = 256      # prompt tokens the encoder may write per sequence and call, at least
SCRATCH_PER_SEQ = 16        # scratch slots per running sequence: COVER's default most seeds a
                            # step (`k_max`); a step with more overrides writes them the slow way
SCRATCH_SHARE = 8           # the scratch takes at most 1/8 of the KV budget


def check_kv_budget(budget: int | None, plan: Any, max_model_len: int) -> None:
    """A given `budget` (kv_cache_memory_bytes; None: sized by the engine) is refused, with the
    numbers, when it holds less than one page (no request could ever run); logged when the
    pages of `plan` (worker/memory.py MemoryPlan) cannot hold one request of `max_model_len`
    tokens (longer requests are then refused one by one, as they come)."""
    if budget is None:
        return
    page_size, num_pages = plan.page_size, plan.num_pages
    page_bytes = plan.kv_bytes_per_token * page_size
    if budget < page_bytes:
        raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV page: one page of "
                         f"{page_size} tokens takes {page_bytes} bytes, and a request of "
                         f"max_model_len ({max_model_len} tokens) needs "
                         f"{-(-max_model_len // page_size) * page_bytes}; raise it (or None: "
                         "sized from memory_utilization)")
    if num_pages * page_size < max_model_len:
        from cover_vllm.logger import init_logger

        init_logger(__name__).warning(
            "kv_cache_memory_bytes=%d holds %d pages = %d tokens, less than one request of "
            "max_model_len (%d tokens, %d bytes): longer requests are refused", budget,
            num_pages, num_pages * page_size, max_model_len,
            -(-max_model_len // page_size) * page_bytes)


@dataclass(frozen=True)
class KVPlan:
    """How one KV budget is spent (`KVLayout.plan`): pages, per-sequence rings and COVER's
    scratch slots, all inside the budget."""

    num_pages: int
    num_rings: int = 0
    num_scratch: int = 0       # slots behind the pages (`KVCache.scratch`); 0: none allocated


def kv_bytes_per_token(dims: ModelDims, dtype: torch.dtype) -> int:
    return 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * dtype.itemsize


@dataclass(frozen=True)
class KVLayout:
    """One model's K/V geometry (the whole model: every kv head)."""

    paged: tuple[tuple[int, int], ...]     # (kv heads, head_dim) of each layer kept in pages
    ringed: tuple[tuple[int, int], ...] = ()   # of each layer kept in per-sequence rings
    ring_len: int = 0                      # slots of one ring (0: no rings)
    encode_chunk: int = 0                  # longest encoder chunk a ring holds beside the window

    @classmethod
    def of(cls, model: torch.nn.Module) -> "KVLayout":
        """From a built model (meta is enough): per-layer shapes and rings where the model has
        them (`kv_layer_shapes()`, `kinds`, `window`, `canvas_length`), else its dims."""
        shapes = getattr(model, "kv_layer_shapes", None)
        if shapes is None:
            d = model.dims
            return cls(((d.num_kv_heads, d.head_dim),) * d.num_layers)
        kinds = model.kinds
        chunk = max(model.canvas_length, MIN_ENCODE_CHUNK)
        per_layer = shapes()
        return cls(tuple(s for s, k in zip(per_layer, kinds) if k != SLIDING),
                   tuple(s for s, k in zip(per_layer, kinds) if k == SLIDING),
                   model.window - 1 + chunk, chunk)

    @staticmethod
    def _bytes(shapes, dtype: torch.dtype) -> int:
        return 2 * sum(h * d for h, d in shapes) * dtype.itemsize

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one position in the paged layers."""
        return self._bytes(self.paged, dtype)

    def ring_bytes(self, dtype: torch.dtype) -> int:
        """K and V of one ring (every ringed layer); 0 without rings."""
        return self._bytes(self.ringed, dtype) * self.ring_len

    def split(self, budget: int, page_size: int, dtype: torch.dtype, max_seqs: int,
              seq_tokens: int) -> tuple[int, int]:
        """(pages, rings) of a `budget`-byte pool: a ring for each sequence that fits with the
        pages of `seq_tokens` positions (up to `max_seqs`, at least one), the rest in pages (at
        least one). Without rings: every byte in pages."""
        page = self.bytes_per_token(dtype) * page_size
        ring = self.ring_bytes(dtype)
        if not ring:
            return max(1, budget // page), 0
        per_seq = ring + -(-seq_tokens // page_size) * page
        rings = min(max_seqs, max(1, budget // per_seq))
        return max(1, (budget - rings * ring) // page), rings

    def scratch_slots(self, budget: int, dtype: torch.dtype, max_seqs: int) -> int:
        """COVER's scratch slots out of a `budget`-byte pool: SCRATCH_PER_SEQ for each of up to
        `max_seqs` sequences, in whole sequences' worth, at most 1/SCRATCH_SHARE of the budget
        (a budget whose share cannot hold one sequence's worth gets none). None for a model
        with rings (its pools are its own, and no COVER step runs there)."""
        if self.ring_len:
            return 0
        seqs = budget // SCRATCH_SHARE // (SCRATCH_PER_SEQ * self.bytes_per_token(dtype))
        return min(max_seqs, seqs) * SCRATCH_PER_SEQ

    def plan(self, budget: int, page_size: int, dtype: torch.dtype, max_seqs: int,
             seq_tokens: int, scratch: bool = True) -> KVPlan:
        """Spend `budget` bytes: the scratch slots first (`scratch_slots`; none unless
        `scratch`: the engine's default decoding verifies seeds), then pages and rings from the
        rest (`split`). Pages + rings + scratch never exceed the budget unless one page alone
        does (a pool has at least one page)."""
        num_scratch = self.scratch_slots(budget, dtype, max_seqs) if scratch else 0
        rest = budget - num_scratch * self.bytes_per_token(dtype)
        num_pages, num_rings = self.split(rest, page_size, dtype, max_seqs, seq_tokens)
        return KVPlan(num_pages, num_rings, num_scratch)


class KVCache:
    """`num_pages * page_size` paged slots, then `num_scratch` scratch slots: where a COVER step
    writes its seeds' fresh K/V (attention/layout.py `build_metadata(scratch=...)`), so the
    cached K/V at a seed's own slot stay and the forward needs no per-layer gather of them.
    A layer's K and V share one tensor [slots, 2 Hkv, d] (`LayerKV`); `k[i]` and `v[i]` are
    its halves. With `pad_slot`, one slot more after those: the one every padded row of a CUDA
    graph's batch writes to and reads (worker/cuda_graphs.py), never a real key."""

    def __init__(self, dims: ModelDims, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", num_scratch: int = 0,
                 pad_slot: bool = False):
        num_slots = num_pages * page_size
        shape = (num_slots + num_scratch + int(pad_slot), 2 * dims.num_kv_heads, dims.head_dim)
        self.num_pages, self.page_size = num_pages, page_size
        self.scratch = (num_slots, num_scratch) if num_scratch else None   # (first slot, slots)
        self.pad_slot = num_slots + num_scratch if pad_slot else None
        self.layers = [LayerKV(torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(dims.num_layers)]
        self.k = [layer[0] for layer in self.layers]
        self.v = [layer[1] for layer in self.layers]

    def layer(self, i: int) -> LayerKV:
        return self.layers[i]

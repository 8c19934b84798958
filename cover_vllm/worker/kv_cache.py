"""KVCache: the per-layer K and V tensors of the paged pool, addressed by slot = page * size + i."""

from __future__ import annotations

import torch

from cover_vllm.models.base import ModelDims


def kv_bytes_per_token(dims: ModelDims, dtype: torch.dtype) -> int:
    return 2 * dims.num_layers * dims.num_kv_heads * dims.head_dim * dtype.itemsize


class KVCache:
    def __init__(self, dims: ModelDims, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        shape = (num_pages * page_size, dims.num_kv_heads, dims.head_dim)   # [slots, Hkv, d]
        self.num_pages, self.page_size = num_pages, page_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(dims.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(dims.num_layers)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

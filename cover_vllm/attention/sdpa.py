"""Torch SDPA backend (CPU and CUDA): paged gather, one fused call, closed-form override rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cover_vllm.attention.base import AttentionBackend, AttentionMetadata
from cover_vllm.attention.correction import apply_override_correction


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        b, q_max = meta.q_index.shape
        qp = q[meta.q_index].transpose(1, 2)                 # [B, H, Qmax, d]
        mask = meta.key_valid[:, None, None, :]              # [B, 1, 1, Kmax]
        o = F.scaled_dot_product_attention(qp, keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        o = o.transpose(1, 2).reshape(b * q_max, q.shape[1], q.shape[2])[meta.out_index]
        return apply_override_correction(o, q, k, v, keys, values, meta)

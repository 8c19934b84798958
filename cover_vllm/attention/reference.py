"""Slow explicit-softmax reference backend: the test oracle for every fast attention path.

Each sequence is handled alone; each override row runs a genuine second attention whose key/value
at every overridden column of that row are the fresh ones (no closed form involved).
"""

from __future__ import annotations

import torch

from cover_vllm.attention.base import AttentionBackend, AttentionMetadata
from cover_vllm.attention.correction import expand_kv_heads


def _softmax_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
    """q [Q, H, d]; keys/values [K, H, d]; valid [K] -> [Q, H, d], in float64."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.double()) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~valid[None, None, :], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values.double())


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_heads = q.shape[1]
        out = torch.empty(q.shape, dtype=torch.float64)
        for b in range(meta.q_index.shape[0]):
            rows = meta.out_index[(meta.out_index // meta.q_index.shape[1]) == b]
            flat = meta.q_index.view(-1)[rows]
            ctx_k = expand_kv_heads(keys[b], num_heads)
            ctx_v = expand_kv_heads(values[b], num_heads)
            out[flat] = _softmax_attend(q[flat], ctx_k, ctx_v, meta.key_valid[b])
        for row in torch.unique(meta.ov_row).tolist():
            b = int(meta.ov_seq[meta.ov_row == row][0])
            row_k = expand_kv_heads(keys[b], num_heads).clone()
            row_v = expand_kv_heads(values[b], num_heads).clone()
            for j in (meta.ov_row == row).nonzero().flatten().tolist():
                col, src = int(meta.ov_col[j]), int(meta.ov_src[j])
                row_k[col] = expand_kv_heads(k[src], num_heads)
                row_v[col] = expand_kv_heads(v[src], num_heads)
            out[row] = _softmax_attend(q[row:row + 1], row_k, row_v, meta.key_valid[b])[0]
        return out.to(q.dtype)

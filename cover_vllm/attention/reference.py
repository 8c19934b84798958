"""Slow explicit-softmax reference backend: the test oracle for every fast attention path.

Each sequence is handled alone; each override row runs a genuine second attention whose key/value
at every overridden column of that row are the fresh ones (no closed form involved). Extra rows
attend per sequence over the canvas keys followed by their own fresh keys, masked row by row.
"""

from __future__ import annotations

import torch

from cover_vllm.attention.base import AttentionBackend, AttentionMetadata
from cover_vllm.attention.correction import expand_kv_heads


def _softmax_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
    """q [Q, H, d]; keys/values [K, H, d]; valid [K] or per row [Q, K] -> [Q, H, d], float64."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.double()) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~(valid if valid.dim() == 2 else valid[None])[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values.double())


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_heads = q.shape[1]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)      # [B, Kmax, Hkv, d]
        out = torch.empty(q.shape, dtype=torch.float64)
        for b in range(meta.q_index.shape[0]):
            rows = meta.out_index[(meta.out_index // meta.q_index.shape[1]) == b]
            flat = meta.q_index.view(-1)[rows]
            ctx_k = expand_kv_heads(keys[b], num_heads)
            ctx_v = expand_kv_heads(values[b], num_heads)
            seq = torch.full_like(flat, b)
            out[flat] = _softmax_attend(q[flat], ctx_k, ctx_v, meta.visible(seq, flat))
        for row in torch.unique(meta.ov_row).tolist():
            b = int(meta.ov_seq[meta.ov_row == row][0])
            row_k = expand_kv_heads(keys[b], num_heads).clone()
            row_v = expand_kv_heads(values[b], num_heads).clone()
            for j in (meta.ov_row == row).nonzero().flatten().tolist():
                col, src = int(meta.ov_col[j]), int(meta.ov_src[j])
                row_k[col] = expand_kv_heads(k[src], num_heads)
                row_v[col] = expand_kv_heads(v[src], num_heads)
            visible = meta.visible(torch.tensor([b]), torch.tensor([row]))
            out[row] = _softmax_attend(q[row:row + 1], row_k, row_v, visible)[0]
        return out.to(q.dtype).flatten(1)

    def attend_extra(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_heads, e_max = q.shape[1], meta.ex_index.shape[1]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)      # [B, Kmax, Hkv, d]
        k_max = keys.shape[1]
        out = torch.empty(meta.num_extra, *q.shape[1:], dtype=torch.float64)
        seq_of = meta.ex_out // e_max
        for b in torch.unique(seq_of).tolist():
            mine = (seq_of == b).nonzero().flatten()             # this sequence's extra rows
            flat = meta.ex_index[b, : mine.numel()]
            ctx_k = expand_kv_heads(torch.cat([keys[b], k[flat]]), num_heads)   # [K + e, H, d]
            ctx_v = expand_kv_heads(torch.cat([values[b], v[flat]]), num_heads)
            cols = torch.cat([torch.arange(k_max), k_max + torch.arange(mine.numel())])
            allowed = meta.ex_allowed[b, : mine.numel()][:, cols]          # [e, K + e]
            out[mine] = _softmax_attend(q[flat], ctx_k, ctx_v, allowed)
        return out.to(q.dtype).flatten(1)

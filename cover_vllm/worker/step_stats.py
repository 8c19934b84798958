"""Per-step statistics for stability-aware verification (ALGORITHMS.md §1.6), from one layer.

* drift: relative change of a position's key between the cached value and this forward's,
  ||k_new - k_old|| / (||k_old|| + eps), averaged over kv heads (taken before the in-place write).
* attn_in: attention mass that still-masked view rows put on each key column, averaged over
  heads (the "downstream influence" d_out of the paper's score).

Both are measured on a single layer (the last) so they cost one extra attention-sized product and
one gather per step, not per layer.
"""

from __future__ import annotations

import torch

from cover_vllm.attention.base import AttentionMetadata
from cover_vllm.attention.correction import expand_kv_heads


def key_drift(k_new: torch.Tensor, k_old: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """[Tw, Hkv, d] x 2 -> [Tw] mean relative change per position."""
    num = (k_new.float() - k_old.float()).norm(dim=-1)
    return (num / (k_old.float().norm(dim=-1) + eps)).mean(dim=-1)


def attention_in_mass(q: torch.Tensor, keys: torch.Tensor, meta: AttentionMetadata,
                      rows: torch.Tensor) -> torch.Tensor:
    """Mass from the flat query rows selected by `rows` [T] (bool) to every key column.

    q [T, H, d]; keys [B, Kmax, Hkv, d] -> [B, Kmax], averaged over heads.
    """
    num_heads = q.shape[1]
    qp = q[meta.q_index].float()                                   # [B, Qmax, H, d]
    kp = expand_kv_heads(keys, num_heads).float()                  # [B, Kmax, H, d]
    scores = torch.einsum("bqhd,bkhd->bhqk", qp, kp) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~meta.key_valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    real = torch.zeros(meta.q_index.numel())                      # padded query rows excluded
    real[meta.out_index] = 1.0
    row_mask = rows[meta.q_index].float() * real.view_as(meta.q_index)   # [B, Qmax]
    return torch.einsum("bhqk,bq->bk", probs, row_mask) / num_heads

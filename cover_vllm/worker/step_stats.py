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
    (b, q_max), (num_heads, head_dim) = meta.q_index.shape, q.shape[1:]
    qp = q.index_select(0, meta.q_index.flatten()).view(b, q_max, num_heads, head_dim)
    scores = torch.matmul(qp.transpose(1, 2).float(),                       # [B, H, Qmax, Kmax]
                          expand_kv_heads(keys, num_heads).permute(0, 2, 3, 1).float())
    probs = torch.softmax(scores * head_dim ** -0.5 + meta.key_bias(torch.float32), dim=-1)
    # weight 1/H for each selected real row (padded rows of the [B, Qmax] layout weigh 0)
    weight = torch.zeros(b * q_max, device=q.device).index_copy_(
        0, meta.out_index, rows[:meta.num_window_tokens].float() / num_heads)
    return torch.matmul(weight.view(b, 1, 1, q_max), probs).sum(1)[:, 0]

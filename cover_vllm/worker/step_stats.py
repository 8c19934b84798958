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
    old = k_old.float()          # widened once; k_new widens exactly inside the subtraction
    num = (k_new - old).norm(dim=-1)
    return (num / (old.norm(dim=-1) + eps)).mean(dim=-1)


def select_rows(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's [window_len] bool row mask (windows back to back on the flat token
    axis) -> ([B, Rmax] flat token of each selected row, pad -> 0; [B, Rmax] bool, real row)."""
    return select_flat(torch.cat(pieces), [int(p.numel()) for p in pieces])


def select_flat(rows: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_rows` of the masks laid end to end ([sum sizes] bool, `sizes` per sequence),
    with a fixed number of tensor ops whatever the batch. Built on the host, where the masks
    are, so the forward has no data-dependent shape."""
    lengths = torch.tensor(sizes, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(sizes)), lengths, output_size=rows.numel())
    flat = rows.nonzero().flatten()                                   # [R] selected tokens
    owner = seq[flat]
    counts = torch.bincount(owner, minlength=len(sizes))              # [B]
    rank = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[owner]
    width = max(int(counts.max()) if flat.numel() else 0, 1)
    index = torch.zeros(len(sizes), width, dtype=torch.long)
    real = torch.zeros(index.shape, dtype=torch.bool)
    index[owner, rank] = flat
    real[owner, rank] = True
    return index, real


def attention_in_mass(q: torch.Tensor, keys: torch.Tensor, meta: AttentionMetadata,
                      index: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Mass from the selected query rows (`select_rows`: [B, Rmax] flat tokens and their
    validity) to every key column: only those rows' scores are formed, not the whole window's.

    q [T, H, d]; keys [B, Kmax, Hkv, d] -> [B, Kmax], averaged over heads.
    """
    (b, r_max), (num_heads, head_dim) = index.shape, q.shape[1:]
    qs = q.index_select(0, index.flatten()).view(b, r_max, num_heads, head_dim)
    scores = torch.matmul(qs.transpose(1, 2).float(),                       # [B, H, Rmax, Kmax]
                          expand_kv_heads(keys, num_heads).permute(0, 2, 3, 1).float())
    seqs = torch.arange(b, device=index.device).repeat_interleave(r_max)
    hidden = ~meta.visible(seqs, index.flatten()).view(b, 1, r_max, -1)      # [B, 1, Rmax, K]
    hidden &= real.view(b, 1, r_max, 1)              # padded rows (weight 0) stay finite
    probs = torch.softmax((scores * head_dim ** -0.5).masked_fill(hidden, float("-inf")), dim=-1)
    weight = real.to(probs.dtype) / num_heads                               # [B, Rmax]
    return torch.matmul(weight.view(b, 1, 1, r_max), probs).sum(1)[:, 0]

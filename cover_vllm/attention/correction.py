"""Closed-form diagonal correction for COVER's override rows (ALGORITHMS.md §1.5).

Row r attended with score z and value V_s at column s (the cached, visible-token K/V). Its
leave-one-out view needs z' = q_r·k_s^mask/√d and v_s^mask there instead. With p = e^(z - LSE) and
p' = e^(z' - LSE), each changed column adds (p'·v' - p·V) to the unnormalised output and (p' - p) to
the normaliser, so any number of columns of one row compose exactly:

    o_r <- (o_r + Σ_s (p'_s v'_s - p_s V_s)) / (1 + Σ_s (p'_s - p_s))

Cost per override: two dot products and one axpy per head, given the row's LSE.
"""

from __future__ import annotations

import torch


def expand_kv_heads(x: torch.Tensor, num_heads: int, dim: int = -2) -> torch.Tensor:
    """[..., Hkv, ...] -> [..., H, ...] along `dim`: query head h reads kv head h // (H / Hkv)."""
    group = num_heads // x.shape[dim]
    return x if group == 1 else x.repeat_interleave(group, dim=dim)


def override_row_lse(q: torch.Tensor, keys: torch.Tensor, meta) -> torch.Tensor:
    """LSE of the override rows' scaled scores, for backends whose kernel does not return it.

    q [T, H, d]; keys [B, Kmax, Hkv, d] -> [S, H] (one gathered key matrix per override).
    """
    q_r = q[meta.ov_row].float()
    ctx_k = expand_kv_heads(keys[meta.ov_seq], q.shape[1]).float()       # [S, K, H, d]
    scores = torch.einsum("shd,skhd->shk", q_r, ctx_k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~meta.key_valid[meta.ov_seq][:, None, :], float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def apply_override_correction(o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              keys: torch.Tensor, values: torch.Tensor, lse: torch.Tensor,
                              meta) -> torch.Tensor:
    """Corrected copy of `o` [T, H, d]; see the module docstring.

    keys/values: the gathered context K/V [B, Kmax, Hkv, d] the main attention used;
    lse: [S, H] log-sum-exp of each override's row in that attention.
    """
    if meta.num_overrides == 0:
        return o
    num_heads, scale = q.shape[1], q.shape[-1] ** -0.5
    q_r = q[meta.ov_row].float()                                               # [S, H, d]
    # index 0: the cached (visible) K/V the row used; index 1: the fresh (masked-input) K/V
    kk = expand_kv_heads(torch.stack((keys[meta.ov_seq, meta.ov_col], k[meta.ov_src])),
                         num_heads).float()                                    # [2, S, H, d]
    vv = expand_kv_heads(torch.stack((values[meta.ov_seq, meta.ov_col], v[meta.ov_src])),
                         num_heads).float()
    p = torch.exp(torch.einsum("shd,tshd->tsh", q_r, kk) * scale - lse)        # [2, S, H]
    weighted = p[..., None] * vv
    num, den = weighted[1] - weighted[0], p[1] - p[0]                          # [S, H, d], [S, H]
    rows = meta.ov_rows
    if len(rows) == meta.num_overrides:          # one override per row: no reduction needed
        order = torch.argsort(meta.ov_inverse)
        num, den = num[order], den[order]
    else:
        num = torch.zeros(len(rows), *num.shape[1:]).index_add_(0, meta.ov_inverse, num)
        den = torch.zeros(len(rows), num_heads).index_add_(0, meta.ov_inverse, den)
    out = o.clone()
    out[rows] = ((o[rows].float() + num) / (1.0 + den)[..., None]).to(o.dtype)
    return out

"""Closed-form diagonal correction for COVER's override rows (ALGORITHMS.md §1.5).

Row r attended with score z and value V_s at column s (the cached, visible-token K/V). Its
leave-one-out view needs z' = q_r·k_s^mask/√d and v_s^mask there instead. With p = e^(z - LSE) and
p' = e^(z' - LSE), each changed column adds (p'·v' - p·V) to the unnormalised output and (p' - p) to
the normaliser, so any number of columns of one row compose exactly:

    o_r <- (o_r + Σ_s (p'_s v'_s - p_s V_s)) / (1 + Σ_s (p'_s - p_s))
"""

from __future__ import annotations

import torch


def expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., Hkv, d] -> [..., H, d]: query head h reads kv head h // (H / Hkv)."""
    group = num_heads // x.shape[-2]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def row_logsumexp(q_rows: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """LSE of scaled scores. q_rows [S, H, d]; keys [S, K, H, d]; key_valid [S, K] -> [S, H]."""
    scores = torch.einsum("shd,skhd->shk", q_rows.float(), keys.float()) * q_rows.shape[-1] ** -0.5
    scores = scores.masked_fill(~key_valid[:, None, :], float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def apply_override_correction(o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              keys: torch.Tensor, values: torch.Tensor, meta) -> torch.Tensor:
    """Correct predictor rows of `o` [T, H, d] in place of a copy; see the module docstring.

    keys/values are the gathered context K/V [B, Kmax, Hkv, d] the main attention used.
    """
    if meta.num_overrides == 0:
        return o
    num_heads, scale = q.shape[1], q.shape[-1] ** -0.5
    q_r = q[meta.ov_row].float()                                        # [S, H, d]
    ctx_k = expand_kv_heads(keys[meta.ov_seq], num_heads)              # [S, K, H, d]
    lse = row_logsumexp(q_r, ctx_k, meta.key_valid[meta.ov_seq])       # [S, H]
    cached_k = ctx_k[torch.arange(len(meta.ov_col)), meta.ov_col]      # [S, H, d]
    cached_v = expand_kv_heads(values[meta.ov_seq, meta.ov_col], num_heads).float()
    fresh_k = expand_kv_heads(k[meta.ov_src], num_heads).float()
    fresh_v = expand_kv_heads(v[meta.ov_src], num_heads).float()
    p_old = torch.exp((q_r * cached_k.float()).sum(-1) * scale - lse)  # [S, H]
    p_new = torch.exp((q_r * fresh_k).sum(-1) * scale - lse)
    num = p_new[..., None] * fresh_v - p_old[..., None] * cached_v     # [S, H, d]
    den = p_new - p_old                                                 # [S, H]
    out = o.float().clone()
    add_num = torch.zeros_like(out).index_add_(0, meta.ov_row, num)
    add_den = torch.zeros(out.shape[:2], dtype=out.dtype).index_add_(0, meta.ov_row, den)
    rows = torch.unique(meta.ov_row)
    out[rows] = (out[rows] + add_num[rows]) / (1.0 + add_den[rows])[..., None]
    return out.to(o.dtype)

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
    scores = scores.masked_fill(~meta.visible(meta.ov_seq, meta.ov_row)[:, None, :], float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def apply_override_correction(o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              keys: torch.Tensor, values: torch.Tensor, lse: torch.Tensor,
                              meta) -> torch.Tensor:
    """Correct the override rows of `o` [T, H, d] in place and return it; see the module docstring.

    keys/values: the gathered context K/V [B, Kmax, Hkv, d] the main attention used;
    lse: [S, H] log-sum-exp of each override's row in that attention.
    About a dozen tensor ops per layer whatever the number of overrides (eager dispatch, not
    FLOPs, is their cost on CPU).
    """
    num = meta.num_overrides
    if num == 0:
        return o
    num_heads, head_dim = q.shape[1], q.shape[2]
    # rows [0, S): the cached (visible) K/V the row used; rows [S, 2S): the fresh (masked) K/V
    kk = torch.cat((keys.flatten(0, 1).index_select(0, meta.ov_key), k.index_select(0, meta.ov_src)))
    vv = torch.cat((values.flatten(0, 1).index_select(0, meta.ov_key),
                    v.index_select(0, meta.ov_src)))
    kk = _f32(expand_kv_heads(kk, num_heads)).view(2, num, num_heads, head_dim)
    vv = _f32(expand_kv_heads(vv, num_heads)).view(2, num, num_heads, head_dim)
    q_r = _f32(q.index_select(0, meta.ov_row))                                # [S, H, d]
    p = torch.exp((kk * q_r).sum(-1) * head_dim ** -0.5 - lse)                 # [2, S, H]
    p[0].neg_()                                         # the cached column leaves, the fresh joins
    if meta.row_limit is not None:                      # a seed past the row's block: neither
        p.mul_(meta.override_visible().to(p.dtype)[None, :, None])
    delta_num = (p.unsqueeze(-1) * vv).sum(0)                                  # [S, H, d]
    delta_den = p.sum(0)                                                       # [S, H]
    # a row with several overrides takes all of them (they compose): sum per row on the flat
    # token axis and read every override's row total back. No distinct-row set (`unique`):
    # nothing here depends on values, so nothing waits for the host. A row with several
    # overrides computes (and writes) the same corrected output once per override.
    rows, t = meta.ov_row, o.shape[0]
    delta_num = delta_num.new_zeros(t, num_heads, head_dim).index_add_(
        0, rows, delta_num).index_select(0, rows)
    delta_den = delta_den.new_zeros(t, num_heads).index_add_(0, rows, delta_den).index_select(
        0, rows)
    before = (o.index_select(0, rows) if o.dtype == torch.float32
              else _rows_output(q, keys, values, lse, meta))
    fixed = (before + delta_num) / (delta_den + 1.0).unsqueeze(-1)
    return o.index_copy_(0, rows, fixed if fixed.dtype == o.dtype else fixed.to(o.dtype))


def _rows_output(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lse: torch.Tensor,
                 meta) -> torch.Tensor:
    """The uncorrected attention output of every override's predictor row, recomputed in fp32
    from its LSE: when the backend's output is bf16/fp16, its rounding would be divided by the
    correction's normaliser (which can be well below 1) and grow. [S, H, d], fp32 (per-row fp32
    copies of the context K/V: the price of the closed form in half precision; `mask` has none)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    rows, seqs = meta.ov_row, meta.ov_seq
    k = expand_kv_heads(keys.index_select(0, seqs), num_heads).float()             # [S, K, H, d]
    v = expand_kv_heads(values.index_select(0, seqs), num_heads).float()
    scores = torch.einsum("rhd,rkhd->rhk", q.index_select(0, rows).float(), k) * head_dim ** -0.5
    p = torch.exp(scores - lse[..., None])
    p = p.masked_fill(~meta.visible(seqs, rows)[:, None, :], 0.0)
    return torch.einsum("rhk,rkhd->rhd", p, v)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()

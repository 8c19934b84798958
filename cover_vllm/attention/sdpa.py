"""Torch SDPA backend (CPU and CUDA): paged gather, one fused call, closed-form override rows.

On CPU the fused flash kernel also returns each row's log-sum-exp, which is all the override
correction needs; elsewhere the LSE of the override rows is computed explicitly (cheap: |S| rows).
Extra rows (WINO's shadow block) run as a second fused call over [canvas keys, their own keys]
with their boolean allowed mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cover_vllm.attention.base import AttentionBackend, AttentionMetadata
from cover_vllm.attention.correction import (apply_override_correction, expand_kv_heads,
                                             override_row_lse)

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        b, q_max = meta.q_index.shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        qp = q[meta.q_index].transpose(1, 2)                   # [B, H, Qmax, d]
        kp, vp = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, Kmax, d]
        lse = None
        if q.device.type == "cpu" and meta.num_overrides:
            o, lse = _FLASH_CPU(qp, expand_kv_heads(kp, num_heads, 1),
                                expand_kv_heads(vp, num_heads, 1), 0.0, False,
                                attn_mask=meta.key_bias(q.dtype))
            lse = lse[meta.ov_seq, :, meta.ov_slot]                        # [S, H]
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.key_valid[:, None, None],
                                               enable_gqa=num_heads != k.shape[1])
        o = o.transpose(1, 2).reshape(b * q_max, num_heads, head_dim)[meta.out_index]
        if meta.num_overrides == 0:
            return o
        if lse is None:
            lse = override_row_lse(q, keys, meta)
        return apply_override_correction(o, q, k, v, keys, values, lse, meta)

    def attend_extra(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        b, e_max = meta.ex_index.shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        qe = q[meta.ex_index].transpose(1, 2)                                 # [B, H, Emax, d]
        ke = torch.cat([keys, k[meta.ex_index]], dim=1).transpose(1, 2)      # [B, Hkv, K+E, d]
        ve = torch.cat([values, v[meta.ex_index]], dim=1).transpose(1, 2)
        o = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=meta.ex_allowed[:, None],
                                           enable_gqa=num_heads != k.shape[1])
        return o.transpose(1, 2).reshape(b * e_max, num_heads, head_dim)[meta.ex_out]

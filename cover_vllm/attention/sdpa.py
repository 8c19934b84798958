"""Torch SDPA backend (CPU and CUDA): paged gather, one fused call, two ways to build COVER's
override rows.

* `closed_form`: attend with the cached K/V at the override positions, then correct each
  predictor row with the closed-form formula (attention/correction.py) from its log-sum-exp.
  On CPU the fused flash kernel returns the LSE; elsewhere the LSE of the override rows is
  computed explicitly (cheap: |S| rows). About 25 small tensor ops per layer.
* `mask`: append each sequence's override positions' fresh K/V as extra key columns and give
  the fused call a per-row mask (`AttentionMetadata.override_bias`) in which a predictor row
  sees its seed's fresh column instead of the cached one. The same two views in the same one
  call, exact without any correction, in six ops per layer; it needs a kernel that takes a
  full [Q, K] mask, which torch's CPU flash kernel does.

`auto` (the default) is `mask` on every device (issue #42): with the cache's scratch slots
(`AttentionMetadata.fresh_key_slots`) the seeds' fresh K/V come with the gathered keys and the
forward of a COVER step has the plain forward's ops (without: two gathers, two concatenations,
two views more per layer), and no per-row fp32 copy of the context K/V. The closed form stays
selectable; it waits for nothing (no `unique`, no host read), but in half precision it
recomputes each override row's output in fp32 from [S, Kmax, H, d] copies of its sequence's K/V
(attention/correction.py).

Extra rows (WINO's shadow block) run as a second fused call over [canvas keys, their own keys]
with their boolean allowed mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cover_vllm.attention.base import (AttentionBackend, AttentionMetadata, pad_queries,
                                       unpad_queries)
from cover_vllm.attention.correction import (apply_override_correction, expand_kv_heads,
                                             override_row_lse)

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


OVERRIDE_MODES = ("auto", "mask", "closed_form")


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def __init__(self, override: str = "auto"):
        if override not in OVERRIDE_MODES:
            raise ValueError(f"override={override!r}; choose one of {list(OVERRIDE_MODES)}")
        self.override = override

    def fresh_columns(self) -> bool:
        return self._mask_overrides()

    def _mask_overrides(self) -> bool:
        """`auto`: the mask on every device (the fewest ops; SDPA's CPU flash kernel and CUDA's
        memory-efficient kernel both take a float mask)."""
        return self.override in ("auto", "mask")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_heads = q.shape[1]
        qp = pad_queries(q, meta)                                         # [B, H, Qmax, d]
        gqa = num_heads != keys.shape[1]
        if meta.num_overrides and self._mask_overrides():
            kp, vp = keys, values                  # [B, Hkv, Kmax + Smax, d]: scratch columns
            if keys.shape[2] == meta.key_slots.shape[1]:         # no scratch: add the columns
                fresh = meta.flat_ov_fresh
                shape = (*meta.ov_fresh.shape, *k.shape[1:])               # [B, Smax, Hkv, d]
                kp = torch.cat((keys, k.index_select(0, fresh).view(shape).transpose(1, 2)), 2)
                vp = torch.cat((values, v.index_select(0, fresh).view(shape).transpose(1, 2)), 2)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.override_bias(q.dtype),
                                               enable_gqa=gqa)
            return unpad_queries(o, meta)
        kp, vp = keys, values                                  # [B, Hkv, Kmax, d]
        lse = None
        if q.device.type == "cpu" and meta.num_overrides:
            o, lse = _FLASH_CPU(qp, expand_kv_heads(kp, num_heads, 1),
                                expand_kv_heads(vp, num_heads, 1), 0.0, False,
                                attn_mask=None if meta.all_keys_valid else meta.key_bias(q.dtype))
            lse = lse[meta.ov_seq, :, meta.ov_slot]                        # [S, H]
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.mask(), enable_gqa=gqa)
        o = unpad_queries(o, meta)
        if meta.num_overrides == 0:
            return o
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)      # [B, Kmax, Hkv, d]
        if lse is None:
            lse = override_row_lse(q, keys, meta)
        apply_override_correction(o.view(q.shape), q, k, v, keys, values, lse, meta)
        return o

    def attend_extra(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        b, e_max = meta.ex_index.shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        qe = q[meta.ex_index].transpose(1, 2)                                 # [B, H, Emax, d]
        ke = torch.cat([keys, k[meta.ex_index].transpose(1, 2)], dim=2)      # [B, Hkv, K+E, d]
        ve = torch.cat([values, v[meta.ex_index].transpose(1, 2)], dim=2)
        o = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=meta.ex_allowed[:, None],
                                           enable_gqa=num_heads != k.shape[1])
        return o.transpose(1, 2).reshape(b * e_max, num_heads * head_dim)[meta.ex_out]

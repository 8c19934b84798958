"""SDAR (JetLM/SDAR-{1.7B,4B,8B}-Chat): a clean-room implementation with official names.

Qwen3 layout (the models are continued-pretrained Qwen3 bases): pre-norm blocks; q/k/v/o
projections (biases only with `attention_bias`); per-head RMSNorm on q and k (weight of size
head_dim) after projection and before RoPE; rotate-half RoPE over the whole head_dim (theta
from config, angles in fp32); grouped-query heads; SwiGLU; `lm_head` untied unless
`tie_word_embeddings`.
`head_dim` comes from config.json and need not be hidden / heads (SDAR-4B: 2560 / 32 = 80 !=
128; the golden model: 64 / 4 = 16 != 24). Attention scale 1/sqrt(head_dim).

Tensor names: `model.embed_tokens.weight`, `model.layers.{i}.{input_layernorm,
post_attention_layernorm}.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`.self_attn.{q,k}_norm.weight`, `model.layers.{i}.mlp.{gate,up,down}_proj.weight`,
`model.norm.weight`, `lm_head.weight` (../shared/golden/README.md "SDAR model").

The model is block-causal (`block_size` in config.json; its own inference script decodes blocks
of it): the engine's paged attention applies that from `ModelSpec.attention`.

Numerics: every RMSNorm of the official file is flash-attn's `rms_norm_fn`, which multiplies
by the weight in fp32 before casting back: its `RMSNorm`s here take that order
(`weight_in_fp32`), the per-head q/k norm included; RoPE runs in the model's dtype, as Qwen3's
does.
"""

from __future__ import annotations

from typing import Any

import torch

from cover_vllm.layers.common import (DecoderLayer, DecoderStack, RMSNorm, SelfAttention,
                                      StackedLM, SwiGLU)
from cover_vllm.layers.rotary import RotaryEmbedding
from cover_vllm.models.base import hf_dims
from cover_vllm.models.query_masks import block_causal_allowed, masked_dense_forward
from cover_vllm.models.spec import ModelSpec


def check_sdar_config(cfg: dict[str, Any]) -> None:
    """ValueError for config.json settings this implementation does not reproduce."""
    if cfg.get("rope_scaling"):
        raise ValueError(f"SDAR rope_scaling={cfg['rope_scaling']!r} is not supported "
                         "(only plain RoPE, rope_scaling null)")
    if cfg.get("use_sliding_window"):
        raise ValueError("SDAR use_sliding_window=true is not supported (the released models "
                         "set false)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"SDAR hidden_act={cfg['hidden_act']!r} is not supported; only 'silu'")


class SDARForCausalLM(StackedLM):
    """`forward(input_ids, attention_mask, position_ids)` is the dense oracle; the engine uses
    `forward_tokens` with its paged, block-causal attention."""

    def __init__(self, spec: ModelSpec):
        cfg = spec.hf_config
        check_sdar_config(cfg)
        d = hf_dims(cfg)
        eps = cfg.get("rms_norm_eps", 1e-6)
        bias = bool(cfg.get("attention_bias", False))
        layers = [DecoderLayer(SelfAttention(d, qkv_bias=bias, o_bias=bias, qk_norm_eps=eps),
                               SwiGLU(d.hidden_size, cfg["intermediate_size"]), eps)
                  for _ in range(d.num_layers)]
        super().__init__(spec, d, DecoderStack(d, layers, eps),
                         RotaryEmbedding(d.head_dim, cfg.get("rope_theta", 1000000.0),
                                         full_precision=False),
                         bool(cfg.get("tie_word_embeddings", False)))
        self.block_size = spec.attention.block_size
        for module in self.modules():      # flash-attn's rms_norm_fn order (see Numerics)
            if isinstance(module, RMSNorm):
                module.weight_in_fp32 = True

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, L, V] (raw, unshifted).

        `attention_mask`: a query x key mask [B or 1, L, L] or [B or 1, 1, L, L] (1 = may
        attend; what the official script passes, read as boolean), or a 2-D key mask [B, L]
        (padded keys hidden) combined with the block-causal mask below.
        Without a mask the official model crashes (`torch.all(None)`); here it uses the
        block-causal mask of config.json's `block_size`, blocks aligned to position 0 — the
        mask its `generate.py` builds. An all-ones mask is plain full attention (the official
        flash-attention branch)."""
        default = block_causal_allowed(input_ids.shape[1], self.block_size, input_ids.device)
        return masked_dense_forward(self, input_ids, attention_mask, position_ids, default)

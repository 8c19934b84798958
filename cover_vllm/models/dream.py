"""Dream (Dream-org/Dream-v0-Instruct-7B): a clean-room implementation with official names.

Qwen2 architecture: pre-norm blocks, q/k/v projections with biases and o_proj without, grouped-query
heads, rotate-half RoPE (theta from config), SwiGLU, untied `lm_head`. Attention is bidirectional.
Logits are returned unshifted; the one-position shift (row j-1 predicts position j) is the decoder's
job and is recorded as `ModelSpec.logit_shift = 1`.

Padding follows the official Dream decoder, not LLaDA: a padded slot neither sees nor is seen, and
position ids count real tokens only (`dream_position_ids`). See ../shared/golden/README.md.
"""

from __future__ import annotations

from typing import Any

import torch

from cover_vllm.layers.common import DecoderLayer, DecoderStack, SelfAttention, StackedLM, SwiGLU
from cover_vllm.layers.rotary import RotaryEmbedding
from cover_vllm.models.base import dense_forward, hf_dims
from cover_vllm.models.spec import ModelSpec


def dream_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] 0/1 mask -> [B, L] int64 position ids as the official Dream decoder builds them.

    Real tokens count 0, 1, 2, ... from the first real token; every padded slot gets position 1.
    A mask without any zero gives plain 0..L-1.
    """
    b, n = attention_mask.shape
    if bool(attention_mask.all()):
        return torch.arange(n, device=attention_mask.device).expand(b, n)
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def dream_attention_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[B, L] 0/1 mask -> [B, 1, L, L] bool, the outer product of the mask with itself (a padded
    slot neither sees nor is seen); None when the mask has no zero."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    m = attention_mask.bool()
    return m[:, None, :, None] & m[:, None, None, :]


class DreamModel(StackedLM):
    """`forward(input_ids, attention_mask)` is the dense oracle; the engine uses `forward_tokens`."""

    def __init__(self, spec: ModelSpec):
        cfg = spec.hf_config
        if cfg.get("rope_scaling"):
            raise ValueError(f"Dream rope_scaling={cfg['rope_scaling']!r} is not supported "
                             "(only plain RoPE, rope_scaling null)")
        d = hf_dims(cfg)
        eps = cfg.get("rms_norm_eps", 1e-6)
        layers = [DecoderLayer(SelfAttention(d, qkv_bias=True, o_bias=False),
                               SwiGLU(d.hidden_size, cfg["intermediate_size"]), eps)
                  for _ in range(d.num_layers)]
        super().__init__(spec, d, DecoderStack(d, layers, eps),
                         RotaryEmbedding(d.head_dim, cfg.get("rope_theta", 10000.0),
                                         full_precision=False),
                         bool(cfg.get("tie_word_embeddings", False)))

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Unshifted logits [B, L, V]. With a zero in `attention_mask`, padded slots are cut off
        both ways and positions count real tokens only (padded rows are not meaningful)."""
        b, n = input_ids.shape
        if attention_mask is None:
            positions = torch.arange(n, device=input_ids.device).expand(b, n)
        else:
            positions = dream_position_ids(attention_mask)
        return dense_forward(self, input_ids, positions, dream_attention_mask(attention_mask))

"""Nemotron-Labs-Diffusion (nvidia/Nemotron-Labs-Diffusion-{3B,8B,14B}): a clean-room
implementation with the released tensor names.

Backbone: transformers' `ministral3` (Ministral-3): pre-norm blocks, RMSNorm (eps from config),
q/k/v/o projections without biases, grouped-query heads, SwiGLU, YaRN RoPE and, after RoPE, the
query scaled by the Llama-4 temperature 1 + beta·ln(1 + floor(pos / original_max)) of absolute
positions (layers/yarn.py; every number from config.json's `rope_parameters`). The LM head is
a separate, untied `diffusion_head`.

Tensor names: `encoder.embed_tokens.weight`, `encoder.layers.{i}.{input_layernorm,
post_attention_layernorm}.weight`, `encoder.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`encoder.layers.{i}.mlp.{gate,up,down}_proj.weight`, `encoder.norm.weight`,
`diffusion_head.weight` (../shared/golden/README.md "Nemotron-Labs-Diffusion").

One set of weights, two attention modes (the official remote code's customised Ministral3):
* diffusion: a block's queries see every cached key and every key of the block (no mask); the
  block's K/V are not written to the cache;
* causal: causal inside the block, every cached key; the K/V are written.
Positions are cache length + index in both. The dense `forward` takes the mode as a flag; the
decoding loops (models/nemotron_decode.py) run the same layers over a KV cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cover_vllm.layers.common import (DecoderLayer, DecoderStack, FusedLinears, SelfAttention,
                                      SwiGLU)
from cover_vllm.layers.rotary import RotaryEmbedding
from cover_vllm.layers.yarn import YarnParams, YarnRotaryEmbedding
from cover_vllm.layers.base import AttentionFn
from cover_vllm.models.base import dense_forward, hf_dims
from cover_vllm.models.spec import ModelSpec


def check_nemotron_config(cfg: dict[str, Any]) -> None:
    """ValueError for config.json settings this implementation does not reproduce."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Nemotron-Labs-Diffusion hidden_act={cfg['hidden_act']!r} is not "
                         "supported; only 'silu'")
    if cfg.get("sliding_window"):
        raise ValueError("Nemotron-Labs-Diffusion sliding_window is not supported (the released "
                         "models set null)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("Nemotron-Labs-Diffusion with biases is not supported (the released "
                         "models have none)")


def nemotron_rope(cfg: dict[str, Any], head_dim: int, q_fraction: float) -> RotaryEmbedding:
    """YaRN RoPE (+ the Llama-4 q scale) when config.json asks for it, else plain RoPE."""
    params = YarnParams.from_config(cfg)
    if params is None:
        rope = cfg.get("rope_parameters") or {}
        return RotaryEmbedding(head_dim, float(rope.get("rope_theta",
                                                        cfg.get("rope_theta", 1e6))))
    return YarnRotaryEmbedding(head_dim, params, q_fraction)


class NemotronLabsDiffusionModel(nn.Module):
    """`forward(input_ids, causal=False)` is the dense oracle (no cache); the engine and the
    decoding loops call `embed` / `forward_tokens` / `compute_logits` with their attention."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        cfg = spec.hf_config
        check_nemotron_config(cfg)
        d = hf_dims(cfg)
        eps = cfg.get("rms_norm_eps", 1e-5)
        layers = [DecoderLayer(SelfAttention(d), SwiGLU(d.hidden_size, cfg["intermediate_size"]),
                               eps) for _ in range(d.num_layers)]
        self.spec, self.dims = spec, d
        self.encoder = DecoderStack(d, layers, eps)
        self.rope = nemotron_rope(cfg, d.head_dim, d.num_heads / (d.num_heads + d.num_kv_heads))
        self.diffusion_head = nn.Linear(d.hidden_size, d.vocab_size, bias=False)
        self.head = FusedLinears(self.diffusion_head)

    def fused_groups(self) -> list[FusedLinears]:
        return [self.head]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]."""
        return self.encoder.embed_tokens(input_ids)

    def forward_tokens(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                       attn: AttentionFn) -> torch.Tensor:
        """[T, hidden] at absolute positions [T] -> [T, hidden] final hidden states."""
        return self.encoder(inputs_embeds, self.rope.at(positions), attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] raw logits."""
        return self.diffusion_head(hidden)

    def forward(self, input_ids: torch.Tensor, causal: bool = False,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, L, V] of a whole sequence with no cache, positions 0..L-1: bidirectional
        (the diffusion mode) or `causal`. `attention_mask` ([L, L] or [B, 1, L, L] bool, True =
        may attend) replaces either."""
        b, n = input_ids.shape
        positions = torch.arange(n, device=input_ids.device).expand(b, n)
        allowed = attention_mask
        if allowed is None and causal:
            allowed = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
        return dense_forward(self, input_ids, positions, allowed)


def mode_mask(num_cached: int, num_new: int, causal: bool,
              device: torch.device | str | None = None) -> torch.Tensor:
    """[num_new, num_cached + num_new] bool: which keys the new tokens see (every cached key;
    inside the new ones all of them in diffusion mode, the earlier ones when `causal`)."""
    allowed = torch.ones(num_new, num_cached + num_new, dtype=torch.bool, device=device)
    if causal:
        allowed[:, num_cached:] = torch.ones(num_new, num_new, dtype=torch.bool,
                                             device=device).tril()
    return allowed


"""The interface every model family implements, and the dense (cache-free) attention path.

A model never owns a KV cache. Its layers call an `AttentionFn(layer, q, k, v) -> o` supplied by
the caller: the dense path below for `model(input_ids, attention_mask)`, or the engine's paged
backend (cover_vllm.attention) for batched, cached steps. The same weights and layers serve both.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from cover_vllm.layers.base import AttentionFn, ModelDims, kv_halves
from cover_vllm.models.spec import ModelSpec


def hf_dims(cfg: dict) -> ModelDims:
    """ModelDims from Hugging Face config keys (num_attention_heads, num_key_value_heads,
    head_dim when it is not hidden / heads, as in SDAR and LLaDA2)."""
    heads = cfg["num_attention_heads"]
    return ModelDims(num_layers=cfg["num_hidden_layers"], num_heads=heads,
                     num_kv_heads=cfg.get("num_key_value_heads") or heads,
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                     hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"])


class DiffusionLM(Protocol):
    """What the engine calls on a model (see cover_vllm.models.llada for the reference family)."""

    spec: ModelSpec
    dims: ModelDims

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden] input embeddings."""

    def forward_tokens(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                       attn: AttentionFn) -> torch.Tensor:
        """[T, hidden] embeddings at absolute `positions` [T] -> [T, hidden] final hidden states."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] raw (unshifted) logits."""


class DenseAttention:
    """Cache-free attention over a padded batch: tokens are laid out as [B * L] in row order.

    `allowed` is a boolean [B, 1, L, L] mask (True = query may attend to key) or None for full
    bidirectional attention.
    """

    def __init__(self, batch: int, seq_len: int, allowed: torch.Tensor | None):
        self.batch, self.seq_len, self.allowed = batch, seq_len, allowed

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor | None = None) -> torch.Tensor:
        if v is None:                                        # k: K and V side by side
            k, v = kv_halves(k)
        b, n = self.batch, self.seq_len
        q4 = q.view(b, n, q.shape[1], q.shape[2]).transpose(1, 2)   # [B, H, L, d]
        k4 = k.view(b, n, k.shape[1], k.shape[2]).transpose(1, 2)   # [B, Hkv, L, d]
        v4 = v.view(b, n, v.shape[1], v.shape[2]).transpose(1, 2)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=self.allowed,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return o.transpose(1, 2).reshape(b * n, -1)


def key_padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """LLaDA-style padding: [B, L] 0/1 mask -> [B, 1, L, L] bool hiding padded *keys* from every
    query (padded queries still attend to real keys); None when the mask has no zero."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    b, n = attention_mask.shape
    return attention_mask.bool()[:, None, None, :].expand(b, 1, n, n)


def dense_forward(model: DiffusionLM, input_ids: torch.Tensor, positions: torch.Tensor,
                  allowed: torch.Tensor | None) -> torch.Tensor:
    """Full-sequence logits [B, L, V] for a padded batch; used by every family's `forward`."""
    b, n = input_ids.shape
    attn = DenseAttention(b, n, allowed)
    hidden = model.forward_tokens(model.embed(input_ids.reshape(-1)), positions.reshape(-1), attn)
    return model.compute_logits(hidden).view(b, n, -1)


def key_padding_forward(model: DiffusionLM, input_ids: torch.Tensor,
                        attention_mask: torch.Tensor | None) -> torch.Tensor:
    """LLaDA-style dense forward (LLaDA, LLaDA-MoE): positions 0..L-1 even with left padding;
    padded keys are hidden from every query, padded queries still attend to real keys."""
    b, n = input_ids.shape
    positions = torch.arange(n, device=input_ids.device).expand(b, n)
    return dense_forward(model, input_ids, positions, key_padding_mask(attention_mask))

"""LLaDA (GSAI-ML/LLaDA-8B-Instruct, LLaDA-1.5): a clean-room implementation with official names.

Pre-norm Llama-style blocks with bidirectional attention, no biases, SwiGLU with `ff_proj` as the
gate, an untied output head `transformer.ff_out`. Tensor names: `model.transformer.blocks.{i}.*`
(../shared/golden/README.md lists them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cover_vllm.layers.base import AttentionFn, ModelDims, ParallelPlan
from cover_vllm.layers.common import FusedLinears, RMSNorm, swiglu
from cover_vllm.layers.rotary import RotaryEmbedding, Rotation, rotate_qk
from cover_vllm.models.base import key_padding_forward
from cover_vllm.models.spec import ModelSpec


def llada_dims(cfg: dict[str, Any]) -> ModelDims:
    heads = cfg["n_heads"]
    kv_heads = cfg.get("n_kv_heads") or heads
    if cfg.get("multi_query_attention"):
        kv_heads = 1
    return ModelDims(num_layers=cfg["n_layers"], num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=cfg["d_model"] // heads, hidden_size=cfg["d_model"],
                     vocab_size=cfg.get("embedding_size") or cfg["vocab_size"])


class LLaDABlock(nn.Module):
    def __init__(self, cfg: dict[str, Any], dims: ModelDims):
        super().__init__()
        d, hd = dims.hidden_size, dims.head_dim
        bias = bool(cfg.get("include_bias", False))
        qkv_bias = bias or bool(cfg.get("include_qkv_bias", False))
        mlp = cfg.get("mlp_hidden_size") or cfg.get("mlp_ratio", 4) * d
        eps = cfg.get("rms_norm_eps", 1e-5)
        self.dims = dims
        self.attn_norm = RMSNorm(d, eps)
        self.q_proj = nn.Linear(d, dims.num_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, dims.num_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, dims.num_kv_heads * hd, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=bias)
        self.ff_norm = RMSNorm(d, eps)
        self.ff_proj = nn.Linear(d, mlp, bias=bias)   # gate (SiLU applied here)
        self.up_proj = nn.Linear(d, mlp, bias=bias)
        self.ff_out = nn.Linear(mlp, d, bias=bias)
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)
        self.gate_up = FusedLinears(self.ff_proj, self.up_proj)
        self.out = FusedLinears(self.attn_out)
        self.down = FusedLinears(self.ff_out)

    def fused_groups(self) -> list[FusedLinears]:
        return [self.qkv, self.gate_up, self.out, self.down]

    def parallel_plan(self) -> ParallelPlan:
        """Heads and the MLP width split over the ranks; attn_out and ff_out reduce."""
        return ParallelPlan(column=("q_proj", "k_proj", "v_proj", "ff_proj", "up_proj"),
                            row=("attn_out", "ff_out"), local_dims=True)

    def forward(self, x: torch.Tensor, layer: int, rot: Rotation,
                attn: AttentionFn) -> torch.Tensor:
        t, dims = x.shape[0], self.dims
        heads, kv_heads = dims.num_heads, dims.num_kv_heads
        qkv = self.qkv(self.attn_norm(x)).view(t, heads + 2 * kv_heads, dims.head_dim)
        q, kv = rotate_qk(qkv, heads, kv_heads, rot)          # K and V side by side: one write
        x = x + self.attn_out(attn(layer, q, kv))                     # attn: [T, H * d]
        return x + self.ff_out(swiglu(self.gate_up(self.ff_norm(x))))


class LLaDAModelLM(nn.Module):
    """`forward(input_ids, attention_mask)` is the dense oracle; the engine uses `forward_tokens`."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        cfg = spec.hf_config
        self.spec, self.dims = spec, llada_dims(cfg)
        d = self.dims
        self.model = nn.Module()
        t = nn.Module()
        t.wte = nn.Embedding(d.vocab_size, d.hidden_size)
        t.blocks = nn.ModuleList(LLaDABlock(cfg, d) for _ in range(d.num_layers))
        t.ln_f = RMSNorm(d.hidden_size, cfg.get("rms_norm_eps", 1e-5))
        self.tied = bool(cfg.get("weight_tying", False))
        if not self.tied:
            t.ff_out = nn.Linear(d.hidden_size, d.vocab_size, bias=False)
            self.head = FusedLinears(t.ff_out)
        self.model.transformer = t
        self.rope = RotaryEmbedding(d.head_dim, cfg.get("rope_theta", 10000.0),    # official:
                                    full_precision=bool(cfg.get("rope_full_precision", True)))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.transformer.wte(input_ids)

    def forward_tokens(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                       attn: AttentionFn) -> torch.Tensor:
        x, rot = inputs_embeds, self.rope.at(positions)
        for i, block in enumerate(self.model.transformer.blocks):
            x = block(x, i, rot, attn)
        return self.model.transformer.ln_f(x)

    def fused_groups(self) -> list[FusedLinears]:
        return [] if self.tied else [self.head]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        t = self.model.transformer
        return F.linear(hidden, t.wte.weight) if self.tied else t.ff_out(hidden)

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, L, V] (padding semantics: `key_padding_forward`)."""
        return key_padding_forward(self, input_ids, attention_mask)

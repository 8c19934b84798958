"""Building blocks shared by the model families: RMSNorm, rotary embedding, SwiGLU MLP, and the
HF Llama/Qwen2-named attention, decoder layer and decoder stack used by Dream and LLaDA-MoE.

Each matches the official code's numerics (RMSNorm and RoPE computed in fp32; see
../shared/golden/README.md "Quirks"). LLaDA keeps its own block (its tensors sit flat on the block
under different names) but uses the same RMSNorm and RotaryEmbedding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from cover_vllm.models.base import AttentionFn, ModelDims


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalisation in fp32, weight applied after casting back."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with fp32 inverse frequencies theta^(-2k/r), applied in fp32.

    Only the first `rotary_dim` (r, default head_dim) channels of each head rotate; the rest pass
    through unchanged (HF `partial_rotary_factor`).
    """

    def __init__(self, head_dim: int, theta: float, rotary_dim: int | None = None):
        super().__init__()
        r = rotary_dim or head_dim
        self.rotary_dim, self.theta = r, theta
        self.register_buffer("inv_freq", self._inv_freq(None), persistent=False)

    def _inv_freq(self, device) -> torch.Tensor:
        r = self.rotary_dim
        exponent = torch.arange(0, r, 2, dtype=torch.float32, device=device) / r
        return 1.0 / (self.theta ** exponent)                              # [r/2], fp32

    def reset_buffers(self) -> None:
        """Recompute `inv_freq` (fp32) after a meta-device build (models/loader.py)."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, num_heads, head_dim]; positions: [num_tokens] (absolute, int)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]   # [T, r/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]              # [T, 1, r]
        x32 = x.float()
        x_rot, x_pass = x32[..., :self.rotary_dim], x32[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
        out = torch.cat([x_rot * emb.cos() + rotated * emb.sin(), x_pass], dim=-1)
        return out.to(x.dtype)


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with HF Llama/Qwen2 tensor names."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SelfAttention(nn.Module):
    """`self_attn.{q,k,v,o}_proj` (+ optional per-head `q_norm`/`k_norm`), RoPE, then the caller's
    AttentionFn (dense or paged). Grouped-query heads: query head h reads kv head h // group."""

    def __init__(self, dims: ModelDims, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm_eps: float | None = None, clip_qkv: float | None = None):
        super().__init__()
        d, hd = dims.hidden_size, dims.head_dim
        self.dims, self.clip_qkv = dims, clip_qkv
        self.q_proj = nn.Linear(d, dims.num_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, dims.num_kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, dims.num_kv_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(dims.num_heads * hd, d, bias=o_bias)
        self.q_norm = RMSNorm(hd, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(hd, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(self, h: torch.Tensor, layer: int, positions: torch.Tensor,
                rope: RotaryEmbedding, attn: AttentionFn) -> torch.Tensor:
        """h: [T, hidden] (already normed) -> [T, hidden] attention output."""
        t, dims = h.shape[0], self.dims
        q = self.q_proj(h).view(t, dims.num_heads, dims.head_dim)       # [T, H, d]
        k = self.k_proj(h).view(t, dims.num_kv_heads, dims.head_dim)    # [T, Hkv, d]
        v = self.v_proj(h).view(t, dims.num_kv_heads, dims.head_dim)    # [T, Hkv, d]
        if self.q_norm is not None:   # per-head RMSNorm after projection, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        o = attn(layer, rope(q, positions), rope(k, positions), v)      # [T, H, d]
        return self.o_proj(o.reshape(t, -1))


class DecoderLayer(nn.Module):
    """Pre-norm block: x += self_attn(input_layernorm(x)); then, with
    h = post_attention_layernorm(x), x += mlp(h) (+ shared_expert(h) when the layer has one)."""

    def __init__(self, self_attn: SelfAttention, mlp: nn.Module, eps: float,
                 shared_expert: nn.Module | None = None):
        super().__init__()
        hidden = self_attn.dims.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp
        self.shared_expert = shared_expert

    def forward(self, x: torch.Tensor, layer: int, positions: torch.Tensor,
                rope: RotaryEmbedding, attn: AttentionFn) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        x = x + self.self_attn(self.input_layernorm(x), layer, positions, rope, attn)
        h = self.post_attention_layernorm(x)
        out = self.mlp(h)
        if self.shared_expert is not None:
            out = out + self.shared_expert(h)
        return x + out


class DecoderStack(nn.Module):
    """The HF `model.` submodule: `embed_tokens`, `layers.{i}`, final `norm`."""

    def __init__(self, dims: ModelDims, layers: list[DecoderLayer], eps: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(dims.hidden_size, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                attn: AttentionFn) -> torch.Tensor:
        """x: [T, hidden] input embeddings, positions: [T] -> [T, hidden] final hidden states."""
        for i, layer in enumerate(self.layers):
            x = layer(x, i, positions, rope, attn)
        return self.norm(x)


class StackedLM(nn.Module, ABC):
    """Shared glue of the HF-named families (Dream, LLaDA-MoE): a `model.` DecoderStack, an
    optional untied `lm_head`, RoPE. Subclasses build the stack and define the dense `forward`
    (their padding semantics differ)."""

    def __init__(self, spec, dims: ModelDims, stack: DecoderStack, rope: RotaryEmbedding,
                 tied: bool):
        super().__init__()
        self.spec, self.dims, self.model, self.rope, self.tied = spec, dims, stack, rope, tied
        if not tied:
            self.lm_head = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]."""
        return self.model.embed_tokens(input_ids)

    def forward_tokens(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                       attn: AttentionFn) -> torch.Tensor:
        """[T, hidden] at positions [T] -> [T, hidden] final hidden states."""
        return self.model(inputs_embeds, positions, self.rope, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] raw (unshifted) logits."""
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(hidden, weight)

    @abstractmethod
    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Dense full-sequence logits [B, L, V]."""

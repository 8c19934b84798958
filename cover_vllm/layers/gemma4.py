"""The Gemma 4 backbone blocks DiffusionGemma runs twice (encoder and decoder): RMSNorm, the two
RoPEs, the GeGLU MLP, the attention of sliding and full layers, the router, and the layer.

Numerics follow ../shared/golden/README.md "Quirks ... (diffusion_gemma)": RMSNorm in fp32 with
the weight used as is (no `1 + w`), q/k RMSNorm per head before RoPE and a weightless one on v,
full layers without v_proj (values = the normed raw key projection), attention scale 1.0 (the
caller's AttentionFn applies it), sandwich norms, a dense GeGLU beside the routed experts, and
the whole hidden state times the half's own `layer_scalar` after each layer.

Tensor parallelism (distributed/tensor_parallel.py): q heads split over the ranks; kv heads
split too when the ranks divide them, else each rank keeps a copy of the one kv head its query
heads read (a full layer's single kv head at TP=2); o_proj, the MLP's down_proj and the experts
are reduced; norms and the router are replicated. Head counts are read from the (sharded)
projections, so a module needs no rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cover_vllm.layers.base import AttentionFn, ParallelPlan
from cover_vllm.layers.common import FusedLinears
from cover_vllm.layers.rotary import Rotation
from cover_vllm.layers.stacked_experts import StackedExperts
from cover_vllm.layers.gemma4_shape import LayerShape


class GemmaRMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-1/2 * weight, all in fp32, cast back at the end; `weight=False`:
    no weight at all (v, the router input, the decoder's input norm)."""

    def __init__(self, size: int, eps: float, weight: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`F.rms_norm` computes in fp32 (a weight of x's dtype widened exactly) and rounds
        once: the official fp32 formula bit for bit, one kernel on CUDA."""
        w, shape = self.weight, (x.shape[-1],)
        if w is not None and w.dtype != x.dtype:        # a weight kept in another dtype
            return F.rms_norm(x.float(), shape, w.float(), self.eps).to(x.dtype)
        return F.rms_norm(x, shape, w, self.eps)


class GemmaRope(nn.Module):
    """Rotate-half RoPE over the whole head (d paired with d + head_dim / 2). The first
    `rotated_pairs` frequency slots are theta^(-2k / head_dim); the rest are 0, so those channels
    pass through unchanged (`proportional` RoPE of the full layers; `default` turns them all)."""

    def __init__(self, head_dim: int, theta: float, rotated_pairs: int):
        super().__init__()
        self.head_dim, self.theta, self.pairs = head_dim, theta, rotated_pairs
        self.register_buffer("inv_freq", self._inv_freq(None), persistent=False)

    def _inv_freq(self, device) -> torch.Tensor:
        if torch.device(device or torch.get_default_device()).type == "meta":   # shapes only
            return torch.empty(self.head_dim // 2, dtype=torch.float32, device="meta")
        exponent = torch.arange(0, 2 * self.pairs, 2, dtype=torch.float32, device=device)
        turning = 1.0 / (self.theta ** (exponent / self.head_dim))                  # [pairs]
        rest = torch.zeros(self.head_dim // 2 - self.pairs, device=device)
        return torch.cat([turning, rest])                                    # [head_dim / 2]

    def reset_buffers(self) -> None:
        """Recompute `inv_freq` (fp32) after a meta-device build (models/loader.py)."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def at(self, positions: torch.Tensor) -> Rotation:
        """The rotation of tokens at absolute `positions` [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]          # [T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]                    # [T, 1, d]
        sin = emb.sin()
        sin[..., :self.head_dim // 2].neg_()
        return Rotation(emb.cos(), sin, self.head_dim)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class GeGLU(nn.Module):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)), gate and up as one GEMM once fused; with
    `pre_norm_eps` an RMSNorm `pre_norm` runs first (the self-conditioning block)."""

    def __init__(self, hidden: int, width: int, pre_norm_eps: float | None = None):
        super().__init__()
        self.pre_norm = GemmaRMSNorm(hidden, pre_norm_eps) if pre_norm_eps is not None else None
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)
        self.down = FusedLinears(self.down_proj)

    def fused_groups(self) -> list[FusedLinears]:
        return [self.gate_up, self.down]

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(column=("gate_proj", "up_proj"), row=("down_proj",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(gelu_tanh(gate) * up)


class Gemma4Attention(nn.Module):
    """q/k/(v)/o projections, per-head q_norm/k_norm, weightless v norm, RoPE; the caller's
    AttentionFn attends (scale 1.0). Full layers have no v_proj: v is the raw k projection."""

    def __init__(self, shape: LayerShape, hidden: int, eps: float):
        super().__init__()
        self.shape, d = shape, shape.head_dim
        self.q_proj = nn.Linear(hidden, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(hidden, shape.num_kv_heads * d, bias=False)
        self.v_proj = None if shape.k_eq_v else nn.Linear(hidden, shape.num_kv_heads * d,
                                                          bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, hidden, bias=False)
        self.q_norm = GemmaRMSNorm(d, eps)
        self.k_norm = GemmaRMSNorm(d, eps)
        self.v_norm = GemmaRMSNorm(d, eps, weight=False)
        self.qkv = FusedLinears(*(lin for lin in (self.q_proj, self.k_proj, self.v_proj) if lin))
        self.out = FusedLinears(self.o_proj)

    def fused_groups(self) -> list[FusedLinears]:
        return [self.qkv, self.out]

    def parallel_plan(self) -> ParallelPlan:
        kv = ("k_proj",) if self.v_proj is None else ("k_proj", "v_proj")
        return ParallelPlan(column=("q_proj", *kv), row=("o_proj",),
                            heads={"q_proj": self.shape.num_heads},
                            kv_heads={name: self.shape.num_kv_heads for name in kv})

    @property
    def local_heads(self) -> tuple[int, int]:
        """(query heads, kv heads) this rank holds (all of them without tensor parallelism)."""
        d = self.shape.head_dim
        return self.q_proj.out_features // d, self.k_proj.out_features // d

    def project(self, h: torch.Tensor, rot: Rotation,
                kv_only: bool = False) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """h [T, hidden] (normed) -> rotated q [T, H, d] (None with `kv_only`), rotated k
        [T, KV, d], v [T, KV, d]."""
        t, d = h.shape[0], self.shape.head_dim
        heads, kv_heads = self.local_heads
        sizes = [heads * d, kv_heads * d] + ([] if self.v_proj is None else [kv_heads * d])
        parts = self.qkv(h).split(sizes, dim=-1)
        k_raw = parts[1].view(t, kv_heads, d)
        v = self.v_norm(k_raw if self.v_proj is None else parts[2].view(t, kv_heads, d))
        k = rot.rotate_(self.k_norm(k_raw))               # fresh tensors: rotated in place
        q = None if kv_only else rot.rotate_(self.q_norm(parts[0].view(t, heads, d)))
        return q, k, v

    def forward(self, h: torch.Tensor, layer: int, rot: Rotation,
                attn: AttentionFn) -> torch.Tensor:
        """h [T, hidden] (normed) -> [T, hidden]."""
        q, k, v = self.project(h, rot)
        return self.o_proj(attn(layer, q, k, v))                        # attn: [T, H * d]


class Router(nn.Module):
    """`router.{scale, proj, per_expert_scale}`: softmax over experts (fp32) of the weightless-
    normed input times `scale` / sqrt(hidden); the top-k probabilities renormalised to sum 1,
    then times each chosen expert's `per_expert_scale`."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k, self.scalar = top_k, hidden ** -0.5
        self.norm = GemmaRMSNorm(hidden, eps, weight=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.proj = nn.Linear(hidden, num_experts, bias=False)      # replicated, not quantized
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))

    def forward(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """r [T, hidden] -> (weights [T, k] fp32, expert ids [T, k])."""
        z = self.norm(r.float()) * self.scale.float() * self.scalar
        probs = F.softmax(F.linear(z, self.proj.weight.float()), dim=-1)       # [T, E]
        top, chosen = probs.topk(self.top_k, dim=-1)
        weights = top / top.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale.float()[chosen], chosen


class Gemma4Layer(nn.Module):
    """h = x + post_attention_layernorm(attn(input_layernorm(x))); then, from r = h:
    dense = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(r))),
    moe = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(r))) routed on r,
    out = (r + post_feedforward_layernorm(dense + moe)) * scalar (the caller's half's)."""

    def __init__(self, shape: LayerShape, cfg: dict):
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.shape = shape
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(shape, hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GeGLU(hidden, cfg["intermediate_size"])
        self.post_feedforward_layernorm_1 = GemmaRMSNorm(hidden, eps)
        self.router = Router(hidden, cfg["num_experts"], cfg["top_k_experts"], eps)
        self.pre_feedforward_layernorm_2 = GemmaRMSNorm(hidden, eps)
        self.experts = StackedExperts(cfg["num_experts"], hidden, cfg["moe_intermediate_size"],
                                      gelu_tanh)
        self.post_feedforward_layernorm_2 = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))     # the decoder's; the encoder's own
                                                            # lives in its half (the model)

    def forward(self, x: torch.Tensor, layer: int, rot: Rotation, attn: AttentionFn,
                scalar: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        r = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), layer, rot, attn))
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(r)))
        weights, chosen = self.router(r)
        moe = self.experts(self.pre_feedforward_layernorm_2(r), weights, chosen)
        moe = self.post_feedforward_layernorm_2(moe)
        return (r + self.post_feedforward_layernorm(dense + moe)) * scalar.to(r.dtype)

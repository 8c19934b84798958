"""LLaDA2.x (inclusionAI/LLaDA2.0-mini, LLaDA2.1-mini): a clean-room implementation with
official names (model_type `llada2_moe`, class `LLaDA2MoeModelLM`).

Pre-norm blocks, attention not causal in the model itself (see `forward`):
* attention: one fused `query_key_value` projection, its output viewed as [H + 2 KV heads,
  head_dim] = q heads, then k, then v; per-head RMSNorm on q and k (`query_layernorm`,
  `key_layernorm`) **before** RoPE; partial RoPE: only the first head_dim *
  partial_rotary_factor channels rotate (rotate-half inside them), the rest pass through;
  output projection `dense`; scale 1/sqrt(head_dim); grouped-query heads;
* MLP: a dense SwiGLU in layers < `first_k_dense_replace`, else a sparse MoE: router
  `mlp.gate` (fp32 logits, sigmoid scores), the routing-only `mlp.gate.expert_bias`,
  group-limited top-k, renormalised unbiased weights times `routed_scaling_factor`, experts
  `mlp.experts.{e}` and an unweighted shared expert `mlp.shared_experts`;
* `model.word_embeddings`, final `model.norm`, `lm_head` (untied in the released models).

Tensor names: `model.layers.{i}.attention.{query_key_value,dense}.weight`,
`.attention.{query,key}_layernorm.weight`, `model.layers.{i}.mlp.{gate,up,down}_proj.weight`
(dense layers), `model.layers.{i}.mlp.gate.{weight,expert_bias}`,
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`,
`model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight`, norms as in Llama
(../shared/golden/README.md "LLaDA2 model"; official modeling_llada2_moe.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cover_vllm.layers.base import AttentionFn, ModelDims, ParallelPlan
from cover_vllm.layers.common import FusedLinears, RMSNorm, SwiGLU
from cover_vllm.layers.rotary import RotaryEmbedding, Rotation
from cover_vllm.layers.expert_stack import ExpertStack, uses_stack
from cover_vllm.models.base import hf_dims
from cover_vllm.models.query_masks import masked_dense_forward
from cover_vllm.models.spec import ModelSpec


def check_llada2_config(cfg: dict[str, Any]) -> None:
    """ValueError for config.json settings this implementation does not reproduce."""
    unsupported = {"rope_scaling": cfg.get("rope_scaling"),
                   "use_sliding_window": cfg.get("use_sliding_window"),
                   "norm_head": cfg.get("norm_head")}
    for key, value in unsupported.items():
        if value:
            raise ValueError(f"LLaDA2 {key}={value!r} is not supported (the released models "
                             "set it null / false)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"LLaDA2 hidden_act={cfg['hidden_act']!r} is not supported; only 'silu'")
    if cfg.get("score_function", "sigmoid") != "sigmoid":
        raise ValueError(f"LLaDA2 score_function={cfg['score_function']!r} is not supported; "
                         "only 'sigmoid'")
    experts, groups = cfg.get("num_experts"), cfg.get("n_group", 1)
    if experts and experts % groups:
        raise ValueError(f"LLaDA2 n_group={groups} must divide num_experts={experts}")


class LLaDA2Attention(nn.Module):
    """`attention.query_key_value` (one GEMM for q, k, v), q/k norm, partial RoPE, then the
    caller's AttentionFn, then `attention.dense`."""

    def __init__(self, cfg: dict[str, Any], dims: ModelDims):
        super().__init__()
        d, hd = dims.hidden_size, dims.head_dim
        self.dims = dims
        self.query_key_value = nn.Linear(d, (dims.num_heads + 2 * dims.num_kv_heads) * hd,
                                         bias=bool(cfg.get("use_qkv_bias", False)))
        eps = cfg.get("rms_norm_eps", 1e-6)
        qk_norm = bool(cfg.get("use_qk_norm", True))
        self.query_layernorm = RMSNorm(hd, eps) if qk_norm else None
        self.key_layernorm = RMSNorm(hd, eps) if qk_norm else None
        # `use_bias` (config class default true; the released configs set false)
        self.dense = nn.Linear(dims.num_heads * hd, d, bias=bool(cfg.get("use_bias", True)))
        self.qkv = FusedLinears(self.query_key_value)
        self.out = FusedLinears(self.dense)

    def fused_groups(self) -> list[FusedLinears]:
        return [self.qkv, self.out]

    def parallel_plan(self) -> ParallelPlan:
        """The fused QKV is column-parallel piece by piece (each rank keeps its heads of q, k
        and v); `dense` is row-parallel."""
        dims, hd = self.dims, self.dims.head_dim
        pieces = (dims.num_heads * hd, dims.num_kv_heads * hd, dims.num_kv_heads * hd)
        return ParallelPlan(column_splits={"query_key_value": pieces}, row=("dense",),
                            local_dims=True)

    def forward(self, h: torch.Tensor, layer: int, rot: Rotation,
                attn: AttentionFn) -> torch.Tensor:
        """h: [T, hidden] (already normed) -> [T, hidden]."""
        t, dims = h.shape[0], self.dims
        heads, kv_heads = dims.num_heads, dims.num_kv_heads
        qkv = self.qkv(h).view(t, heads + 2 * kv_heads, dims.head_dim)   # [T, H + 2KV, d]
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        if self.query_layernorm is not None:     # q/k norm before RoPE (official order)
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = rot.rotate_(q), rot.rotate_(k)    # partial RoPE: rot.rotary_dim channels
        return self.dense(attn(layer, q, k, v))                       # attn: [T, H * d]


class LLaDA2Gate(nn.Module):
    """`mlp.gate`: the router. `expert_bias` is a persistent buffer in the official code (saved
    in every checkpoint); here it is a parameter so the loader fills it."""

    def __init__(self, cfg: dict[str, Any], hidden_size: int):
        super().__init__()
        experts = cfg["num_experts"]
        self.top_k, self.n_group = cfg["num_experts_per_tok"], cfg.get("n_group", 1)
        self.topk_group = cfg.get("topk_group", self.n_group)
        self.scaling = float(cfg.get("routed_scaling_factor", 1.0))
        self.weight = nn.Parameter(torch.empty(experts, hidden_size))
        self.expert_bias = nn.Parameter(torch.zeros(experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, k] fp32, expert ids [T, k])."""
        t = x.shape[0]
        logits = F.linear(x.float(), self.weight.float())                  # [T, E] fp32
        scores = torch.sigmoid(logits)
        routing = scores + self.expert_bias          # the bias picks experts, never weighs them
        # group score = sum of each group's 2 best routing scores (official: topk(2) fixed)
        groups = routing.view(t, self.n_group, -1)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)                 # [T, G]
        keep = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0).bool()
        allowed = group_mask[:, :, None].expand_as(groups).reshape(t, -1)
        chosen = routing.masked_fill(~allowed, float("-inf")).topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)                                   # unbiased
        if self.top_k > 1:                    # renormalised (norm_topk_prob is never read)
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class LLaDA2SparseMoE(nn.Module):
    """Router + routed experts + an unweighted shared expert. Under tensor parallelism the
    experts' partial outputs are summed by one all-reduce of the block's output."""

    def __init__(self, cfg: dict[str, Any], hidden_size: int):
        super().__init__()
        width = cfg["moe_intermediate_size"]
        self.gate = LLaDA2Gate(cfg, hidden_size)
        self.experts = nn.ModuleList(SwiGLU(hidden_size, width, reduce_output=False)
                                     for _ in range(cfg["num_experts"]))
        shared = cfg.get("num_shared_experts")
        self.shared_experts = (SwiGLU(hidden_size, width * shared, reduce_output=False)
                               if shared else None)
        self.stack: ExpertStack | None = None      # off the CPU: grouped GEMMs, no host sync

    def stack_experts(self, copy: bool) -> None:
        self.stack = ExpertStack.build(self.experts, copy)

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(reduce_output=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]. One batched call per expert over its tokens; the
        weighted sum is accumulated in fp32 and cast back once, as the official `moe_infer`."""
        weights, chosen = self.gate(x)                       # [T, k] fp32, [T, k]
        if uses_stack(self.stack, x):
            out = self.stack(x, weights, chosen, torch.float32)
            return out if self.shared_experts is None else out + self.shared_experts(x)
        k = chosen.shape[1]
        flat = chosen.reshape(-1)                            # [T * k], token-major
        order = flat.argsort(stable=True)                    # slots grouped by expert
        token = order // k
        slot_weight = weights.reshape(-1)[order, None]       # [T * k, 1] fp32
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = token[start:start + count]
                out.index_add_(0, rows, expert(x[rows]).float() * slot_weight[start:start + count])
                start += count
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class LLaDA2DecoderLayer(nn.Module):
    """x += attention(input_layernorm(x)); x += mlp(post_attention_layernorm(x))."""

    def __init__(self, cfg: dict[str, Any], dims: ModelDims, index: int):
        super().__init__()
        eps, d = cfg.get("rms_norm_eps", 1e-6), dims.hidden_size
        self.input_layernorm = RMSNorm(d, eps)
        self.attention = LLaDA2Attention(cfg, dims)
        self.post_attention_layernorm = RMSNorm(d, eps)
        sparse = cfg.get("num_experts") and index >= cfg.get("first_k_dense_replace", 0)
        self.mlp = LLaDA2SparseMoE(cfg, d) if sparse else SwiGLU(d, cfg["intermediate_size"])

    def forward(self, x: torch.Tensor, layer: int, rot: Rotation,
                attn: AttentionFn) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), layer, rot, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LLaDA2MoeModelLM(nn.Module):
    """`forward(input_ids, attention_mask, position_ids)` is the dense oracle; the engine uses
    `forward_tokens` with its paged, block-causal attention."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        cfg = spec.hf_config
        check_llada2_config(cfg)
        self.spec, self.dims = spec, hf_dims(cfg)
        d = self.dims
        self.model = nn.Module()
        self.model.word_embeddings = nn.Embedding(d.vocab_size, d.hidden_size)
        self.model.layers = nn.ModuleList(LLaDA2DecoderLayer(cfg, d, i)
                                          for i in range(d.num_layers))
        self.model.norm = RMSNorm(d.hidden_size, cfg.get("rms_norm_eps", 1e-6))
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(d.hidden_size, d.vocab_size, bias=False)
            self.head = FusedLinears(self.lm_head)
        # partial RoPE: rotary dim = int(head_dim * partial_rotary_factor), as HF's default
        # rope init computes it (the configs' `rotary_dim` key is not read by the official code)
        rotary = int(d.head_dim * cfg.get("partial_rotary_factor", 1.0))
        self.rope = RotaryEmbedding(d.head_dim, cfg.get("rope_theta", 10000.0), rotary,
                                    full_precision=False)

    def fused_groups(self) -> list[FusedLinears]:
        return [] if self.tied else [self.head]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]."""
        return self.model.word_embeddings(input_ids)

    def forward_tokens(self, inputs_embeds: torch.Tensor, positions: torch.Tensor,
                       attn: AttentionFn) -> torch.Tensor:
        """[T, hidden] at positions [T] -> [T, hidden] final hidden states."""
        x, rot = inputs_embeds, self.rope.at(positions)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, i, rot, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] raw logits."""
        if self.tied:
            return F.linear(hidden, self.model.word_embeddings.weight)
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, L, V].

        `attention_mask`: a query x key mask [B or 1, 1, L, L] or [B or 1, L, L], 1 = may
        attend (the official `generate` passes the log of such a block-lower-triangular
        matrix), or a 2-D key mask [B, L] (padded keys hidden from every query). Without a mask
        attention is fully bidirectional, as the official SDPA path (golden `logits_nomask`)."""
        return masked_dense_forward(self, input_ids, attention_mask, position_ids, None)

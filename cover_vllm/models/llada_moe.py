"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B): a clean-room implementation with official names.

OLMoE-style blocks with bidirectional attention: per-head q/k RMSNorm (weight of size head_dim)
right after projection and before RoPE; a sparse MoE MLP whose router takes a softmax in fp32 over
all experts, keeps the top-k and does NOT renormalise them (the official code ignores
`norm_topk_prob`), then sums the chosen experts' SwiGLU outputs weighted by those probabilities.
Padding as in LLaDA: padded keys are hidden, positions stay 0..L-1.

Tensor names (i = layer, e = expert): `model.embed_tokens.weight`,
`model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight`,
`model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `.self_attn.{q,k}_norm.weight`,
`model.layers.{i}.mlp.gate.weight` (router [E, hidden]),
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`, `model.norm.weight`, `lm_head.weight`.

Read from the official modeling_lladamoe.py, not exercised by the golden checkpoint:
* `moe_layer_freq[i] == 0` makes layer i dense: `model.layers.{i}.mlp.{gate,up,down}_proj` of
  width `dense_intermediate_size`. A missing `moe_layer_freq` means every layer is MoE.
* `shared_expert_intermediate_size` set: MoE layers get `model.layers.{i}.shared_expert.*` (a
  SwiGLU fed the same normed input), added to the routed output.
* `moe_router_enable_expert_bias`: `model.layers.{i}.mlp.expert_bias` [E] is added to the softmax
  probabilities before top-k, and the biased values are the mixture weights (as the official code
  does). The official code keeps it as a buffer; here it is a parameter so the loader fills it.
* `attention_bias` gives all four projections a bias; `clip_qkv` clamps q, k (after their norm) and
  v; `partial_rotary_factor` < 1 rotates only the first head_dim * factor channels.
Assumed: only `moe_router_score_function == "softmax"` (anything else raises ValueError).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cover_vllm.layers.base import ModelDims, ParallelPlan
from cover_vllm.layers.common import DecoderLayer, DecoderStack, SelfAttention, StackedLM, SwiGLU
from cover_vllm.layers.rotary import RotaryEmbedding
from cover_vllm.layers.expert_stack import ExpertStack, uses_stack
from cover_vllm.models.base import hf_dims, key_padding_forward
from cover_vllm.models.spec import ModelSpec


def moe_layer_flags(cfg: dict[str, Any]) -> list[bool]:
    """True for each layer whose MLP is the sparse MoE, False for a dense layer."""
    n = cfg["num_hidden_layers"]
    freq = cfg.get("moe_layer_freq")
    if freq is None or freq == 1:
        return [True] * n
    if not isinstance(freq, list) or len(freq) != n:
        raise ValueError(f"moe_layer_freq={freq!r}: expected a list of {n} 0/1 flags (one per "
                         "layer) or 1")
    return [bool(f) for f in freq]


class SparseMoE(nn.Module):
    """`mlp.gate` router + `mlp.experts.{e}` SwiGLUs; top-k of an fp32 softmax, not renormalised.

    Tensor parallel: the router is replicated (every rank routes identically); each expert is
    split like a dense SwiGLU but left unreduced, and the block all-reduces its sum once."""

    def __init__(self, cfg: dict[str, Any], hidden_size: int):
        super().__init__()
        num_experts = cfg["num_experts"]
        self.top_k = cfg["num_experts_per_tok"]
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden_size, cfg["expert_intermediate_size"],
                                            reduce_output=False)
                                     for _ in range(num_experts))
        self.expert_bias = (nn.Parameter(torch.zeros(num_experts))
                            if cfg.get("moe_router_enable_expert_bias") else None)
        self.stack: ExpertStack | None = None      # off the CPU: grouped GEMMs, no host sync

    def stack_experts(self, copy: bool) -> None:
        self.stack = ExpertStack.build(self.experts, copy)

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(reduce_output=True)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, k] in x.dtype, expert ids [T, k])."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)   # [T, E]
        if self.expert_bias is not None:
            probs = probs + self.expert_bias
        weights, chosen = probs.topk(self.top_k, dim=-1)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]. One batched call per expert over the tokens routed to it;
        contributions are accumulated in expert order, as the official loop does."""
        weights, chosen = self.route(x)
        if uses_stack(self.stack, x):
            return self.stack(x, weights, chosen, x.dtype)
        flat = chosen.reshape(-1)                                # [T * k], token-major
        order = flat.argsort(stable=True)                        # slots grouped by expert
        token = order // self.top_k                              # [T * k] token of each slot
        slot_weight = weights.reshape(-1)[order, None]           # [T * k, 1]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                rows = token[start:start + count]
                out.index_add_(0, rows, expert(x[rows]) * slot_weight[start:start + count])
                start += count
        return out


def _decoder_layer(cfg: dict[str, Any], dims: ModelDims, is_moe: bool) -> DecoderLayer:
    eps = cfg.get("rms_norm_eps", 1e-5)
    bias = bool(cfg.get("attention_bias", False))
    attn = SelfAttention(dims, qkv_bias=bias, o_bias=bias,
                         qk_norm_eps=eps if cfg.get("qk_layernorm", True) else None,
                         clip_qkv=cfg.get("clip_qkv"))
    if not is_moe:
        return DecoderLayer(attn, SwiGLU(dims.hidden_size, cfg["dense_intermediate_size"]), eps)
    shared = cfg.get("shared_expert_intermediate_size")
    return DecoderLayer(attn, SparseMoE(cfg, dims.hidden_size), eps,
                        SwiGLU(dims.hidden_size, shared) if shared else None)


class LLaDAMoEModelLM(StackedLM):
    """`forward(input_ids, attention_mask)` is the dense oracle; the engine uses `forward_tokens`."""

    def __init__(self, spec: ModelSpec):
        cfg = spec.hf_config
        if cfg.get("rope_scaling"):
            raise ValueError(f"LLaDA-MoE rope_scaling={cfg['rope_scaling']!r} is not supported "
                             "(only plain RoPE, rope_scaling null)")
        score = cfg.get("moe_router_score_function", "softmax")
        if score != "softmax":
            raise ValueError(f"moe_router_score_function={score!r} is not supported; "
                             "only 'softmax'")
        d = hf_dims(cfg)
        layers = [_decoder_layer(cfg, d, is_moe) for is_moe in moe_layer_flags(cfg)]
        rotary_dim = int(d.head_dim * cfg.get("partial_rotary_factor", 1.0))
        super().__init__(spec, d, DecoderStack(d, layers, cfg.get("rms_norm_eps", 1e-5)),
                         RotaryEmbedding(d.head_dim, cfg.get("rope_theta", 50000.0), rotary_dim,
                                         full_precision=False),
                         bool(cfg.get("tie_word_embeddings", False)))

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, L, V] (padding semantics: `key_padding_forward`)."""
        return key_padding_forward(self, input_ids, attention_mask)

"""The interface every model family implements, and the dense (cache-free) attention path.

A model never owns a KV cache. Its layers call an `AttentionFn(layer, q, k, v) -> o` supplied by
the caller: the dense path below for `model(input_ids, attention_mask)`, or the engine's paged
backend (cover_vllm.attention) for batched, cached steps. The same weights and layers serve both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from cover_vllm.models.spec import ModelSpec

# (layer index, q [T, H, d], k [T, Hkv, d], v [T, Hkv, d]) -> o [T, H, d]; q and k already rotated.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelDims:
    """Sizes the engine needs for KV pages and FLOP counts."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int


def hf_dims(cfg: dict) -> ModelDims:
    """ModelDims from Hugging Face config keys (num_attention_heads, num_key_value_heads,
    head_dim when it is not hidden / heads, as in SDAR and LLaDA2)."""
    heads = cfg["num_attention_heads"]
    return ModelDims(num_layers=cfg["num_hidden_layers"], num_heads=heads,
                     num_kv_heads=cfg.get("num_key_value_heads") or heads,
                     head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                     hidden_size=cfg["hidden_size"], vocab_size=cfg["vocab_size"])


@dataclass(frozen=True)
class ParallelPlan:
    """How tensor parallelism splits one module's own Linear layers, declared by the module in
    `parallel_plan()` (distributed/tensor_parallel.py collects them; it never looks at types).
    Names are attributes of the declaring module."""

    column: tuple[str, ...] = ()          # output rows sliced: rank r keeps its 1/N of the rows
    row: tuple[str, ...] = ()             # input columns sliced; partial outputs all-reduced
    row_unreduced: tuple[str, ...] = ()   # input columns sliced; a parent reduces the sum
                                          # (a sparse MoE's experts)
    column_splits: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # a fused column Linear whose rows are pieces side by side (LLaDA2's query_key_value: q, k,
    # v rows): rank r keeps its 1/N of every piece, so each keeps its own heads of q, k and v
    reduce_output: bool = False           # all-reduce the module's output (a sparse MoE block)
    local_dims: bool = False              # the module's `.dims` become the rank's head counts
    heads: dict[str, int] = field(default_factory=dict)
    # column Linears holding this many (query) heads side by side: the ranks must split them
    # into whole heads
    kv_heads: dict[str, int] = field(default_factory=dict)
    # column Linears holding this many kv heads: split into whole heads when the ranks divide
    # them; with fewer heads than ranks (a divisor of the ranks) each rank keeps a copy of the
    # one head its query heads read (a replicated kv head: DiffusionGemma's single one at TP=2)
    param_splits: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    # the module's own parameters (not Linears), name -> (dim, pieces): rank r keeps its 1/N of
    # every piece along `dim` (stacked MoE experts [E, 2M, H] / [E, H, M] split like an MLP)


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
                 v: torch.Tensor) -> torch.Tensor:
        b, n = self.batch, self.seq_len
        q4 = q.view(b, n, q.shape[1], q.shape[2]).transpose(1, 2)   # [B, H, L, d]
        k4 = k.view(b, n, k.shape[1], k.shape[2]).transpose(1, 2)   # [B, Hkv, L, d]
        v4 = v.view(b, n, v.shape[1], v.shape[2]).transpose(1, 2)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=self.allowed,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return o.transpose(1, 2).reshape(b * n, q.shape[1], q.shape[2])


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

"""Model FLOPs: the one definition used by the engine's per-request counters and the benchmarks.

A forward over T query tokens (window rows of every canvas copy, plus extra rows), each
attending over K keys, with logits on N rows costs

    2 * P * T                 linear layers (P = weights every token multiplies through:
                              every matrix but the embedding and the LM head)
  + 4 * layers * H * d * A    attention scores and weighted values (A = query-key pairs, T * K)
  + 2 * hidden * vocab * N    the LM head on the rows whose logits are read

Per request, `RequestMetrics.flops` sums this over the forwards it took part in (its own
window, refresh forwards included: a refresh is a window over the whole canvas). **Model FLOPs
per token** = total FLOPs of a set of requests / their generated tokens (decoded generation
slots, `RequestMetrics.decoded_tokens`), so a refresh's cost shows next to NFE. Norms, RoPE,
softmax and the COVER override bookkeeping are not counted (each is O(T * hidden), small next to
the linear layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cover_vllm.layers.base import ModelDims


@dataclass(frozen=True)
class FlopModel:
    """The FLOP coefficients of one (whole, unsharded) model."""

    params_per_token: int      # P above
    attn_per_pair: int         # 4 * layers * H * d
    head_per_row: int          # 2 * hidden * vocab
    self_conditioning_per_row: int = 0   # a uniform-state decoder row's self-conditioning
                                         # (DiffusionGemma: `decoder_row_flops()`)

    @classmethod
    def of(cls, model: torch.nn.Module, dims: ModelDims) -> "FlopModel":
        """From a built model (the meta device is enough) and its dims (all heads); a model
        whose tokens do not go through every weight (a MoE counted as its active experts, not
        all of them) gives its own (`flop_coefficients()`: the three fields, in order)."""
        own = getattr(model, "flop_coefficients", None)
        if callable(own):
            row = getattr(model, "decoder_row_flops", None)
            return cls(*own(), row() if callable(row) else 0)
        total = sum(p.numel() for p in model.parameters() if p.dim() == 2)
        per_token = total - 2 * dims.vocab_size * dims.hidden_size     # embedding and head
        return cls(per_token, 4 * dims.num_layers * dims.num_heads * dims.head_dim,
                   2 * dims.hidden_size * dims.vocab_size)

    def forward(self, tokens: int, attn_pairs: int, logit_rows: int) -> float:
        """Model FLOPs of running `tokens` query rows over `attn_pairs` query-key pairs, with
        logits on `logit_rows` rows."""
        return float(2 * self.params_per_token * tokens + self.attn_per_pair * attn_pairs
                     + self.head_per_row * logit_rows)


def item_shape(item) -> tuple[int, int, int]:
    """(tokens, attention pairs, logit rows) of one WorkItem: every canvas copy's window over the
    keys each row sees (the whole canvas, or a block-causal row's blocks), the extra rows over the canvas and each other, the view's predictor rows."""
    copies = len(item.canvases)
    length = int(item.canvases[0].key_slots.numel())
    extra = item.num_extra
    tokens = item.window_len * copies + extra
    pairs = item.attention_pairs() * copies + extra * (length + extra)
    rows = (item.view_end - item.view_start) * copies + extra
    return tokens, pairs, rows


def canvas_item_shapes(item) -> tuple[tuple[int, int], tuple[int, int]]:
    """((encoded tokens, their attention pairs), (canvas rows, theirs)) of one CanvasItem: its
    n encoded tokens at positions s.. each over the keys up to itself, its canvas of C rows over
    everything encoded and the canvas."""
    n, s = item.num_encode, item.encode_start
    c = 0 if item.canvas_ids is None else int(item.canvas_ids.numel())
    return (n, n * s + n * (n + 1) // 2), (c, c * (item.canvas_start + c))


def canvas_item_flops(model: FlopModel, item) -> tuple[float, float, int]:
    """(encoder FLOPs, decoder FLOPs, query rows) of one CanvasItem (`canvas_item_shapes`): no
    head on the encoded tokens (the encoder's outputs are never read); the head and, after a
    canvas's first step, self-conditioning on every canvas row."""
    (n, enc_pairs), (c, dec_pairs) = canvas_item_shapes(item)
    encoder = model.forward(n, enc_pairs, 0) if n else 0.0
    decoder = model.forward(c, dec_pairs, c) if c else 0.0
    if c and item.self_conditioning:
        decoder += float(model.self_conditioning_per_row * c)
    return encoder, decoder, n + c


def flops_per_token(metrics) -> float:
    """Model FLOPs per generated token over a list of RequestMetrics (0 if nothing decoded)."""
    tokens = sum(m.decoded_tokens for m in metrics)
    return sum(m.flops for m in metrics) / tokens if tokens else 0.0

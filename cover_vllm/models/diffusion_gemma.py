"""DiffusionGemma (google/diffusiongemma-26B-A4B-it): a clean-room implementation with official
names (model_type `diffusion_gemma`, class `DiffusionGemmaForBlockDiffusion`), text only.

Uniform-state block diffusion on a Gemma 4 backbone (layers/gemma4.py). A **causal encoder**
runs the prompt (and every finished canvas) through the layers and keeps only their K/V; a
**bidirectional decoder** runs a canvas of `canvas_length` tokens through the same layers (same
weights, its own `layer_scalar`s) against that K/V and returns the canvas logits. The decoder's
input is RMSNorm_noweight(embed(canvas) * sqrt(hidden) + sc), where sc is the self-conditioning
GeGLU of the previous step's (temperature-scaled) logits turned into a soft embedding (0 when
there are none). Logits: the tied embedding over the final norm, in fp32, soft-capped
30 * tanh(x / 30). Every quirk: ../shared/golden/README.md "Quirks ... (diffusion_gemma)".

Two ways to run it, one set of layers:
* `forward(input_ids, attention_mask, decoder_input_ids, self_conditioning_logits,
  decoder_attention_mask)`: transformers' arguments, dense, cache-free (the oracle; the golden
  forward.safetensors is checked against it).
* `encode_paged` / `decode_paged` (diffusion_gemma_paged.py): the engine's route, the encoder
  writing K/V into paged per-layer pools and the decoder reading them back.

Tensor names: text weights live once under `model.decoder.` (the encoder shares them), the
encoder's own scalars under `model.encoder.language_model.layers.{i}.layer_scalar`, no
`lm_head` (tied). The vision tower (`model.encoder.vision_tower.*`,
`model.encoder.embed_vision.*`) is never built or read (the registry lists it as ignored);
image inputs raise ValueError.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cover_vllm.layers.base import ModelDims
from cover_vllm.layers.gemma4 import GeGLU, GemmaRMSNorm, GemmaRope, Gemma4Layer
from cover_vllm.models.diffusion_gemma_paged import (DecodeBatch, DenseDecoderAttention,
                                                     DenseEncoderAttention, EncodeBatch, PagedKV,
                                                     PagedDecoderAttention, PagedEncoderAttention)
from cover_vllm.models.gemma4_config import SLIDING, check_config, layer_shapes
from cover_vllm.models.spec import ModelSpec


SOFT_CHUNK_BYTES = 1 << 26      # self-conditioning: fp32 softmax rows taken at once (64 MiB)


class _Scalar(nn.Module):
    """The encoder's `layer_scalar` of one layer (its own, not the decoder's)."""

    def __init__(self):
        super().__init__()
        self.layer_scalar = nn.Parameter(torch.ones(1))


class DiffusionGemmaForBlockDiffusion(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        cfg = spec.hf_config
        check_config(cfg)
        self.spec, self.shapes = spec, layer_shapes(cfg)
        hidden, vocab, eps = cfg["hidden_size"], cfg["vocab_size"], cfg.get("rms_norm_eps", 1e-6)
        self.window = int(cfg["sliding_window"])
        self.canvas_length = int(cfg.get("canvas_length", 256))
        self.softcap = cfg.get("final_logit_softcapping")
        self.top_k = cfg["top_k_experts"]
        base = next((s for s in self.shapes if s.sliding), self.shapes[0])
        # nominal sizes (the sliding layers'); each layer's own: `shapes`, `kv_layer_shapes()`
        self.dims = ModelDims(len(self.shapes), base.num_heads, base.num_kv_heads, base.head_dim,
                              hidden, vocab)
        self.model = nn.Module()
        self.model.decoder = dec = nn.Module()
        dec.embed_tokens = nn.Embedding(vocab, hidden)
        dec.layers = nn.ModuleList(Gemma4Layer(s, cfg) for s in self.shapes)
        dec.norm = GemmaRMSNorm(hidden, eps)
        dec.self_conditioning = GeGLU(hidden, cfg["intermediate_size"], pre_norm_eps=eps)
        self.model.encoder = nn.Module()
        self.model.encoder.language_model = nn.Module()
        self.model.encoder.language_model.layers = nn.ModuleList(_Scalar() for _ in self.shapes)
        self.input_norm = GemmaRMSNorm(hidden, eps, weight=False)    # the decoder's post_norm
        ropes = list(dict.fromkeys((s.head_dim, s.rope_theta, s.rotated_pairs)
                                   for s in self.shapes))
        self.ropes = nn.ModuleList(GemmaRope(*r) for r in ropes)
        self.rope_of = [ropes.index((s.head_dim, s.rope_theta, s.rotated_pairs))
                        for s in self.shapes]

    # ---- the pieces both routes share -----------------------------------------------------
    @property
    def kinds(self) -> list[str]:
        """Each layer's kind: "sliding_attention" or "full_attention"."""
        return [s.kind for s in self.shapes]

    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        """(kv heads this rank holds, head_dim) of every layer: the paged pools' shapes."""
        return [(layer.self_attn.local_heads[1], s.head_dim)
                for layer, s in zip(self.model.decoder.layers, self.shapes)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: the embedding times sqrt(hidden) (a fp32 scalar cast to the
        weights' dtype)."""
        table = self.model.decoder.embed_tokens
        scale = torch.tensor(table.weight.shape[1] ** 0.5, dtype=torch.float32)
        return table(input_ids) * scale.to(table.weight.dtype)

    def decoder_inputs(self, canvas_ids: torch.Tensor,
                       self_conditioning_logits: torch.Tensor | None,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
        """[N] canvas ids (+ [M, V] previous logits of the rows `rows` [M], None: all N) ->
        [N, hidden] decoder input embeddings; rows without logits get sc = 0 exactly (no
        biases), as if the module were skipped."""
        x = self.embed(canvas_ids)
        if self_conditioning_logits is not None:
            sc = self.model.decoder.self_conditioning(self._soft_embedding(
                self_conditioning_logits))
            x = x + sc if rows is None else x.index_add(0, rows, sc)
        return self.input_norm(x)

    def _soft_embedding(self, logits: torch.Tensor) -> torch.Tensor:
        """[M, V] logits -> softmax(logits, fp32) @ embedding * sqrt(hidden): [M, hidden], the
        full-vocabulary softmax taken SOFT_CHUNK_BYTES of rows at a time."""
        table = self.model.decoder.embed_tokens.weight
        scale = torch.tensor(table.shape[1] ** 0.5, dtype=torch.float32).to(table.dtype)
        rows = max(1, SOFT_CHUNK_BYTES // (logits.shape[-1] * 4))
        parts = [F.softmax(chunk.float(), dim=-1).to(table.dtype) @ table
                 for chunk in logits.split(rows)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)) * scale

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attn, encoder: bool):
        """Run the stack: the encoder's scalars and, on its last layer, only the K/V (its
        outputs are never read); the decoder's scalars and the final norm."""
        rots = [rope.at(positions) for rope in self.ropes]
        layers = self.model.decoder.layers
        scalars = (self.model.encoder.language_model.layers if encoder else layers)
        for i, layer in enumerate(layers):
            rot = rots[self.rope_of[i]]
            if encoder and i == len(layers) - 1:
                _, k, v = layer.self_attn.project(layer.input_layernorm(x), rot, kv_only=True)
                attn.write(i, k, v)
                return None
            x = layer(x, i, rot, attn, scalars[i].layer_scalar)
        return self.model.decoder.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] (final-normed) -> [N, vocab] fp32 logits, soft-capped."""
        logits = F.linear(hidden, self.model.decoder.embed_tokens.weight).float()
        if self.softcap:          # in place: tanh(x / cap) * cap, one [N, V] tensor at a time
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    # ---- the dense route: transformers' forward -------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None,
                self_conditioning_logits: torch.Tensor | None = None,
                decoder_attention_mask: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, **image_inputs) -> torch.Tensor:
        """Canvas logits [B, C, V] (fp32, soft-capped) of `decoder_input_ids` [B, C] after the
        prompt `input_ids` [B, P], as `DiffusionGemmaForBlockDiffusion.forward(...).logits`:
        encoder positions 0..P-1 (not shifted by left padding), decoder positions P..P+C-1.
        `attention_mask` [B, P] hides pad keys from the encoder, `decoder_attention_mask`
        [B, P + C] from the decoder (pass both for padded input); `self_conditioning_logits`
        [B, C, V] are the previous step's processed logits."""
        if pixel_values is not None or image_inputs:
            raise ValueError("DiffusionGemma is served text-only here: its vision tower is not "
                             "loaded, so pixel_values / image inputs "
                             f"{sorted(image_inputs) or ['pixel_values']} are not supported")
        if decoder_input_ids is None:
            raise ValueError("DiffusionGemma's forward needs decoder_input_ids (the canvas)")
        (b, p), c = input_ids.shape, decoder_input_ids.shape[1]
        device = input_ids.device
        enc = DenseEncoderAttention(b, p, self._windows(), attention_mask)
        self._layers(self.embed(input_ids.reshape(-1)),
                     torch.arange(p, device=device).repeat(b), enc, encoder=True)
        sc = (None if self_conditioning_logits is None
              else self_conditioning_logits.reshape(b * c, -1))
        dec = DenseDecoderAttention(enc.kv, c, self._windows(), decoder_attention_mask)
        hidden = self._layers(self.decoder_inputs(decoder_input_ids.reshape(-1), sc),
                              torch.arange(p, p + c, device=device).repeat(b), dec,
                              encoder=False)
        return self.compute_logits(hidden).view(b, c, -1)

    def _windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention)."""
        return [self.window if s.sliding else None for s in self.shapes]

    # ---- the paged route: what the engine calls -------------------------------------------
    def allocate_kv(self, num_slots: int, sliding_slots: int | None = None,
                    dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> PagedKV:
        """Empty per-layer K/V pools (this rank's kv heads) of `num_slots` slots, sliding layers
        `sliding_slots` (default the same: e.g. a ring of >= window - 1 + the longest chunk per
        sequence instead of every page), in the model's dtype and on its device unless given."""
        weight = self.model.decoder.embed_tokens.weight
        sliding = num_slots if sliding_slots is None else sliding_slots
        slots = [sliding if s.sliding else num_slots for s in self.shapes]
        return PagedKV(self.kv_layer_shapes(), slots, dtype or weight.dtype,
                       device or weight.device)

    def encode_paged(self, batch: EncodeBatch, kv: PagedKV) -> None:
        """Encode `batch` (each sequence's not-yet-encoded tokens: a prompt, a prompt chunk or
        a finished canvas): their K/V of every layer are written at `batch.write_slots`, each
        token attending causally over its sequence's keys (`batch.keys`: earlier tokens and
        these), the window applied on sliding layers. Returns nothing: the encoder's hidden
        states are never read."""
        attn = PagedEncoderAttention(batch, kv, self.kinds, self.window)
        self._layers(self.embed(batch.input_ids), batch.positions, attn, encoder=True)

    def decode_paged(self, batch: DecodeBatch, kv: PagedKV) -> torch.Tensor:
        """One denoising forward of B canvases [B, C] against their encoded context
        (`batch.keys`; sliding layers read only the last window - 1 positions before the
        canvas, full layers all of them; nothing is written). Returns logits [B, C, V], fp32,
        soft-capped, on the model's device: the caller scales them by the step's temperature
        and hands them back as the next step's `self_conditioning_logits`."""
        b, c = batch.canvas_ids.shape
        sc, rows = batch.self_conditioning_logits, batch.self_conditioning_rows
        sc = None if sc is None else sc.reshape(-1, sc.shape[-1])
        if rows is not None:                          # canvas -> its C flat rows
            rows = (rows[:, None] * c + torch.arange(c, device=rows.device)).reshape(-1)
        attn = PagedDecoderAttention(batch, kv, self.kinds, self.window)
        hidden = self._layers(self.decoder_inputs(batch.canvas_ids.reshape(-1), sc, rows),
                              batch.positions.reshape(-1), attn, encoder=False)
        return self.compute_logits(hidden).view(b, c, -1)

    # ---- FLOPs (cover_vllm/flops.py) ------------------------------------------------------
    def flop_coefficients(self) -> tuple[int, int, int]:
        """flops.FlopModel's (params_per_token, attn_per_pair, head_per_row): every weight of
        the layer stack a token multiplies through, the MoE counted as its top-k experts (not
        all of them); 4 * heads * head_dim summed over the layers (as if every layer saw every
        key: sliding layers see at most a window); the tied head on logit rows. The decoder's
        extra per canvas row (self-conditioning): `decoder_row_flops()`."""
        per_token = 0
        for layer in self.model.decoder.layers:
            parts = (layer.self_attn, layer.mlp, layer.router)
            per_token += sum(_linear_weights(m) for m in parts)
            experts = layer.experts                 # gate_up 2M x H and down H x M per expert
            per_token += self.top_k * 3 * experts.width * self.dims.hidden_size
        attn = sum(4 * s.num_heads * s.head_dim for s in self.shapes)
        return per_token, attn, 2 * self.dims.hidden_size * self.dims.vocab_size

    def decoder_row_flops(self) -> int:
        """FLOPs a decoder row adds to `flop_coefficients()`'s when self-conditioning runs:
        the soft embedding (probabilities [V] @ embedding [V, hidden]) and its GeGLU."""
        sc = _linear_weights(self.model.decoder.self_conditioning)
        return 2 * self.dims.vocab_size * self.dims.hidden_size + 2 * sc


def _linear_weights(module: nn.Module) -> int:
    """Weights of every Linear under `module` (from their sizes: quantized ones count too)."""
    return sum(m.in_features * m.out_features for m in module.modules()
               if isinstance(m, nn.Linear))

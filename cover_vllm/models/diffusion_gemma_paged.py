"""DiffusionGemma's attention: the dense (cache-free) encoder/decoder pair of its `forward`, and
the paged pair the engine drives (`encode_paged` / `decode_paged`), with what they read.

Attention scale 1.0 everywhere (no 1/sqrt(d): the q/k norms carry it), grouped-query heads,
no soft-capping. Visibility (../shared/golden/README.md, "Encoder masks" / "Decoder masks"):
* encoder: causal; on sliding layers also key position > query position - window; pad keys
  (a 2-D mask, or a -1 position in a paged table) hidden; positions are absolute.
* decoder: every canvas row sees the whole canvas (no mask inside it) and the encoded context:
  all of it on full layers, only the last window - 1 positions before the canvas on sliding
  layers (the window crops the context; it is not applied per query).

Paged layout: per-layer pools [num_slots, kv_heads_i, head_dim_i] (`PagedKV`: the layers have
different head sizes and kv heads, so each has its own). A batch says, per layer kind, where
each token's K/V go (`write_slots`) and which slots hold each sequence's keys (`KVTable`,
slots plus absolute positions). The model reads the positions, not the layout: a caller may give
sliding layers a ring of pages holding only the last window - 1 positions (older columns would
be masked anyway) and full layers every page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cover_vllm.layers.kv_layout import gather_heads
from cover_vllm.models.gemma4_config import SLIDING


class PagedKV:
    """K and V pools of every layer: k[i], v[i] [num_slots[i], kv_heads_i, head_dim_i] (sliding
    layers may have fewer slots than full ones: they only ever need the last window - 1)."""

    def __init__(self, shapes: list[tuple[int, int]], num_slots: list[int], dtype: torch.dtype,
                 device: torch.device | str):
        self.num_slots = num_slots
        self.k = [torch.zeros(n, h, d, dtype=dtype, device=device)
                  for n, (h, d) in zip(num_slots, shapes)]
        self.v = [torch.zeros(n, h, d, dtype=dtype, device=device)
                  for n, (h, d) in zip(num_slots, shapes)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]


@dataclass
class KVTable:
    """The encoded keys of each sequence of a batch, for one layer kind."""

    slots: torch.Tensor          # [B, K] long: pool slot of each key column (padding: any slot)
    positions: torch.Tensor      # [B, K] long: its absolute position; -1 = no key (padding)


@dataclass
class EncodeBatch:
    """One encoder call: each sequence's not-yet-encoded tokens, back to back on one axis."""

    input_ids: torch.Tensor               # [T]
    positions: torch.Tensor               # [T] absolute positions (each sequence ascending)
    seq_lens: list[int]                   # tokens of each sequence (sum T)
    write_slots: dict[str, torch.Tensor]  # layer kind -> [T] slot of each token's K/V
    keys: dict[str, KVTable]              # layer kind -> each sequence's keys: its earlier
                                          # tokens and these (written before they are read)


@dataclass
class DecodeBatch:
    """One denoising forward of B canvases of C tokens."""

    canvas_ids: torch.Tensor              # [B, C]
    positions: torch.Tensor               # [B, C] absolute (canvas k of a sequence: after
                                          # everything encoded before it)
    keys: dict[str, KVTable]              # layer kind -> each canvas's encoded context
    self_conditioning_logits: torch.Tensor | None = None   # [B', C, V] the previous step's
                                          # processed logits, on the model's device
    self_conditioning_rows: torch.Tensor | None = None     # [B'] long: the canvases those
                                          # logits belong to (None: all B); the others (a
                                          # canvas's first step) get none


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            allowed: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, Q, d], k/v [B, KV, K, d], allowed bool [B, 1, Q or 1, K] -> [B, H, Q, d]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _encoder_allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, key_ok: torch.Tensor,
                     window: int | None) -> torch.Tensor:
    """[B, Q] query and [B, K] key positions, [B, K] real keys -> [B, 1, Q, K] bool: causal,
    windowed (key > query - window), real keys only."""
    allowed = key_ok[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        allowed &= k_pos[:, None, :] > q_pos[:, :, None] - window
    return allowed[:, None]


class DenseEncoderAttention:
    """The encoder over a padded batch [B, P] (positions 0..P-1); keeps every layer's K/V
    ([B, P, KV, d]) for the decoder in `kv`."""

    def __init__(self, batch: int, length: int, windows: list[int | None],
                 attention_mask: torch.Tensor | None):
        self.batch, self.length, self.windows = batch, length, windows
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(windows)
        self.key_mask = attention_mask
        self._allowed: dict[int | None, torch.Tensor] = {}

    def allowed(self, window: int | None, device) -> torch.Tensor:
        if window not in self._allowed:
            pos = torch.arange(self.length, device=device).expand(self.batch, -1)
            ok = (torch.ones_like(pos, dtype=torch.bool) if self.key_mask is None
                  else self.key_mask.to(device).bool())
            allowed = _encoder_allowed(pos, pos, ok, window)
            # a pad query sees nothing: let it see itself so its (never read) output is finite
            eye = torch.eye(self.length, dtype=torch.bool, device=device)
            self._allowed[window] = allowed | eye
        return self._allowed[window]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = (self.batch, self.length, *k.shape[1:])
        self.kv[layer] = (k.view(shape), v.view(shape))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        self.write(layer, k, v)
        b, n = self.batch, self.length
        q4 = q.view(b, n, *q.shape[1:]).transpose(1, 2)
        k4, v4 = (t.transpose(1, 2) for t in self.kv[layer])
        o = _attend(q4, k4, v4, self.allowed(self.windows[layer], q.device))
        return o.transpose(1, 2).reshape(b * n, -1)


class DenseDecoderAttention:
    """The decoder over B canvases of C tokens against a DenseEncoderAttention's K/V."""

    def __init__(self, kv: list, canvas: int, windows: list[int | None],
                 decoder_attention_mask: torch.Tensor | None):
        self.kv, self.canvas, self.windows = kv, canvas, windows
        self.key_mask = decoder_attention_mask          # [B, P + C] or None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        ctx_k, ctx_v = self.kv[layer]                           # [B, P, KV, d]
        b, p = ctx_k.shape[:2]
        window = self.windows[layer]
        lo = 0 if window is None else max(0, p - (window - 1))  # sliding: last w - 1 only
        shape = (b, self.canvas, *k.shape[1:])
        keys = torch.cat([ctx_k[:, lo:], k.view(shape)], dim=1).transpose(1, 2)
        values = torch.cat([ctx_v[:, lo:], v.view(shape)], dim=1).transpose(1, 2)
        allowed = None
        if self.key_mask is not None:
            mask = self.key_mask.to(q.device).bool()
            allowed = torch.cat([mask[:, lo:p], mask[:, p:p + self.canvas]], dim=1)
            allowed = allowed[:, None, None, :]
        q4 = q.view(b, self.canvas, *q.shape[1:]).transpose(1, 2)
        o = _attend(q4, keys, values, allowed)
        return o.transpose(1, 2).reshape(b * self.canvas, -1)


class PagedEncoderAttention:
    """The encoder over a flat batch of sequences' new tokens: writes their K/V into the pools,
    then each sequence's tokens attend over its table (causal, windowed on sliding layers)."""

    def __init__(self, batch: EncodeBatch, kv: PagedKV, kinds: list[str], window: int):
        self.batch, self.kv, self.kinds, self.window = batch, kv, kinds, window
        lens = batch.seq_lens
        b, q_max = len(lens), max(lens)
        device = batch.input_ids.device
        self.q_index = torch.zeros(b, q_max, dtype=torch.long)     # flat token of each row
        real = torch.zeros(b, q_max, dtype=torch.bool)
        at = 0
        for i, n in enumerate(lens):
            self.q_index[i, :n] = torch.arange(at, at + n)
            real[i, :n] = True
            at += n
        self.q_index, self.real = self.q_index.to(device), real.to(device)
        self.out_index = real.flatten().nonzero()[:, 0].to(device)     # real rows of [B*Qmax]
        self._allowed: dict[str, torch.Tensor] = {}

    def allowed(self, kind: str) -> torch.Tensor:
        if kind not in self._allowed:
            table = self.batch.keys[kind]
            q_pos = self.batch.positions[self.q_index]                   # [B, Qmax]
            window = self.window if kind == SLIDING else None
            allowed = _encoder_allowed(q_pos, table.positions, table.positions >= 0, window)
            self._allowed[kind] = allowed | ~self.real[:, None, :, None]  # pad rows: finite
        return self._allowed[kind]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = self.batch.write_slots[self.kinds[layer]]
        k_pool, v_pool = self.kv.layer(layer)
        k_pool.index_copy_(0, slots, k.to(k_pool.dtype))
        v_pool.index_copy_(0, slots, v.to(v_pool.dtype))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        self.write(layer, k, v)
        kind = self.kinds[layer]
        table = self.batch.keys[kind]
        k_pool, v_pool = self.kv.layer(layer)
        keys, values = gather_heads(k_pool, table.slots), gather_heads(v_pool, table.slots)
        o = _attend(q[self.q_index].transpose(1, 2), keys, values, self.allowed(kind))
        return o.transpose(1, 2).reshape(-1, q.shape[1] * q.shape[2])[self.out_index]


class PagedDecoderAttention:
    """The decoder over B canvases [B, C] against their paged context; nothing is written."""

    def __init__(self, batch: DecodeBatch, kv: PagedKV, kinds: list[str], window: int):
        self.batch, self.kv, self.kinds, self.window = batch, kv, kinds, window
        self._allowed: dict[str, torch.Tensor] = {}

    def allowed(self, kind: str) -> torch.Tensor:
        if kind not in self._allowed:
            table = self.batch.keys[kind]
            ok = table.positions >= 0
            if kind == SLIDING:                       # the last window - 1 before the canvas
                start = self.batch.positions[:, :1]
                ok &= table.positions > start - self.window
            canvas = torch.ones_like(self.batch.positions, dtype=torch.bool)
            self._allowed[kind] = torch.cat([ok, canvas], dim=1)[:, None, None, :]
        return self._allowed[kind]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        b, c = self.batch.canvas_ids.shape
        kind = self.kinds[layer]
        table = self.batch.keys[kind]
        k_pool, v_pool = self.kv.layer(layer)
        keys = torch.cat([gather_heads(k_pool, table.slots),
                          k.view(b, c, *k.shape[1:]).transpose(1, 2).to(k_pool.dtype)], dim=2)
        values = torch.cat([gather_heads(v_pool, table.slots),
                            v.view(b, c, *v.shape[1:]).transpose(1, 2).to(v_pool.dtype)], dim=2)
        q4 = q.view(b, c, *q.shape[1:]).transpose(1, 2)
        o = _attend(q4, keys, values, self.allowed(kind))
        return o.transpose(1, 2).reshape(b * c, -1)

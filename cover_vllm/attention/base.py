"""Attention contract of the engine: batch layout metadata and the backend interface.

A batch holds several sequences. Each contributes a *window* of query tokens (contiguous canvas
positions) laid out back to back as the flat token axis [T]. Every sequence attends over its whole
canvas, positions 0..L-1, read from the paged KV cache after the window's fresh K/V have been
written in place. *Override* pairs (s, r) implement COVER's two views (ALGORITHMS.md §1.4): the
fresh K/V of position s are NOT written to s's slot (at most to a scratch slot, `store_slots`),
so every query reads the cached (visible-token) K/V at s, except predictor row r = π(s), which
sees the fresh (masked-input) K/V of s.

*Extra rows* (WINO's shadow block, ALGORITHMS.md §2.3) are query rows that are not canvas
positions. They follow every window on the flat token axis (all windows first, then each
sequence's extra rows in sequence order), attend over their sequence's canvas keys and over each
other's fresh keys under a per-row allowed mask, and are never keys of a window row nor written to
the cache.

*Visibility*: which key columns a query row sees is the one thing every backend, the COVER
correction and the statistics layer read from `AttentionMetadata.visible` / `mask` / `key_bias`
(never from `key_valid` directly). A column is visible when it is a real key of the row's
sequence (not padding, not hidden) and, for a block-causal sequence (`SeqLayout.causal_block` =
B), lies in a block at or before the row's own: column j < (p // B + 1)·B for a row at canvas
position p, blocks aligned to absolute position 0 (LLaDA2.x, SDAR).

The metadata of a batch is built by `build_metadata` (attention/layout.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from cover_vllm.layers.base import kv_halves
from cover_vllm.layers.kv_layout import gather_kv, heads_first, window_kv


@dataclass
class SeqLayout:
    """One sequence of a batch, as the model runner describes it."""

    window_start: int             # first query position
    window_len: int               # number of query positions
    key_slots: torch.Tensor       # [L] cache slot of canvas positions 0..L-1
    override: list[tuple[int, int]]   # (position s, predictor row position r); both in window
    hidden_keys: torch.Tensor | None = None   # [L] bool, True = key hidden from every query
    extra_allowed: torch.Tensor | None = None  # [E, L + E] bool: extra rows' visible keys
    positions: torch.Tensor | None = None     # [window_len] sorted canvas positions of a sparse
                                              # window (None: window_start.. contiguous)
    causal_block: int | None = None  # block-causal attention with blocks of this size (None:
                                     # every row sees every key column, `full`)
    causal_commit: bool = False      # block-causal: rows in blocks before the window's last
                                     # one see keys <= their position (a causal commit)

    def key_limits(self) -> torch.Tensor | None:
        """[window_len] exclusive bound on the key columns of each query row (block-causal), or
        None when every row sees all L columns."""
        length = int(self.key_slots.numel())
        if self.causal_block is None:
            return None
        b = self.causal_block
        pos = self.window_positions()
        limit = ((pos // b + 1) * b).clamp(max=length)
        if self.causal_commit:
            limit = torch.where(pos < pos.max() // b * b, pos + 1, limit)
        return None if bool((limit >= length).all()) else limit

    def window_positions(self) -> torch.Tensor:
        """[window_len] canvas position of every query row."""
        if self.positions is not None:
            return self.positions
        return torch.arange(self.window_start, self.window_start + self.window_len)

    def row_of(self, positions: list[int]) -> list[int]:
        """Window rows (0-based) of canvas positions that are in the window."""
        if self.positions is None:
            return [p - self.window_start for p in positions]
        return torch.searchsorted(self.positions, torch.tensor(positions)).tolist()


@dataclass
class AttentionMetadata:
    """Index tensors shared by all layers of one forward. T = tokens (Tm window tokens, then Te
    extra rows), B = sequences, S = overrides, Emax = most extra rows of one sequence."""

    write_index: torch.Tensor    # [Tw] flat tokens whose fresh K/V are written to the cache
    write_slots: torch.Tensor    # [Tw] their cache slots
    q_index: torch.Tensor        # [B, Qmax] flat token of each padded query row (pad -> 0)
    out_index: torch.Tensor      # [Tm] position of each window token in the [B * Qmax] layout
    key_slots: torch.Tensor      # [B, Kmax] cache slot of each key column (pad -> 0)
    key_valid: torch.Tensor      # [B, Kmax] bool
    ov_src: torch.Tensor         # [S] flat token of override position s (fresh K/V source)
    ov_row: torch.Tensor         # [S] flat token of its predictor row r
    ov_seq: torch.Tensor         # [S] sequence index
    ov_col: torch.Tensor         # [S] key column of s (= its canvas position)
    ov_key: torch.Tensor         # [S] row of (ov_seq, ov_col) in the flattened [B * Kmax] keys
    ov_slot: torch.Tensor        # [S] query slot of the predictor row in its [Qmax] window
    ov_extra: torch.Tensor       # [S] rank of the override within its sequence
    ov_fresh: torch.Tensor       # [B, Smax] flat token of each sequence's override sources
    num_overrides: int
    ex_index: torch.Tensor       # [B, Emax] flat token of each padded extra row (pad -> 0)
    ex_out: torch.Tensor         # [Te] position of each extra row in the [B * Emax] layout
    ex_allowed: torch.Tensor     # [B, Emax, Kmax + Emax] bool: canvas columns, then extra rows
    write_all: bool = False      # every window token is written, in order (write_index = arange)
    dense_queries: bool = False  # every window has Qmax tokens: q_index and out_index = arange
    all_keys_valid: bool = False  # every row sees every key column: no mask at all
    row_limit: torch.Tensor | None = None   # [Tm] exclusive bound on the key columns each window
                                            # token sees (block-causal); None: no bound
    store_slots: torch.Tensor | None = None  # [Tm] cache slot every window token is written to,
                                             # seeds' redirected to their scratch slots (None:
                                             # no scratch; write `write_index` at `write_slots`)
    fresh_key_slots: torch.Tensor | None = None  # [B, Kmax + Smax] `key_slots`, then the scratch
                                                 # slots of `ov_fresh` (pad -> 0, masked out)
    keys_are_window: bool = False  # every window is its whole canvas in order, no override or
                                   # extra row: the keys are the fresh K/V (no gather needed)
    fresh_key_slots_flat: torch.Tensor | None = None  # [B * (Kmax + Smax)] `fresh_key_slots`
                                                      # flattened by the host: a piece of the
                                                      # step's one copy (no device op)
    override_hidden: torch.Tensor | None = None  # [B, 1, Qmax, Kmax + Smax] bool: the columns
                                                 # a row does not see in the `mask` override
                                                 # mode (~`override_allowed`; None: built on
                                                 # first use)
    _key_bias: torch.Tensor | None = None
    _override_bias: torch.Tensor | None = None
    _flat_key_slots: torch.Tensor | None = None
    _flat_ov_fresh: torch.Tensor | None = None
    _flat_fresh_key_slots: torch.Tensor | None = None
    _mask: tuple[torch.Tensor | None] | None = None
    _padded_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    _window_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_window_tokens(self) -> int:
        return int(self.out_index.numel())

    @property
    def num_extra(self) -> int:
        return int(self.ex_out.numel())

    @property
    def flat_key_slots(self) -> torch.Tensor:
        """[B * Kmax] `key_slots` flattened, made once per forward (every layer's gather)."""
        if self._flat_key_slots is None:
            self._flat_key_slots = self.key_slots.reshape(-1)
        return self._flat_key_slots

    @property
    def flat_fresh_key_slots(self) -> torch.Tensor:
        """[B * (Kmax + Smax)] `fresh_key_slots` flattened (by the host, or once per forward)."""
        if self._flat_fresh_key_slots is None:
            self._flat_fresh_key_slots = (self.fresh_key_slots.reshape(-1)
                                          if self.fresh_key_slots_flat is None
                                          else self.fresh_key_slots_flat)
        return self._flat_fresh_key_slots

    @property
    def flat_ov_fresh(self) -> torch.Tensor:
        """[B * Smax] `ov_fresh` flattened, made once per forward (the `mask` override mode)."""
        if self._flat_ov_fresh is None:
            self._flat_ov_fresh = self.ov_fresh.reshape(-1)
        return self._flat_ov_fresh

    def padded_rows(self, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices ([B, 1, Qmax] flat token, [1, H, 1] head) that gather q [T, H, d] straight
        into SDPA's padded [B, H, Qmax, d] (`pad_queries`); made once per forward."""
        if self._padded_rows is None or self._padded_rows[1].shape[1] != num_heads:
            heads = torch.arange(num_heads, device=self.q_index.device).view(1, num_heads, 1)
            self._padded_rows = (self.q_index.unsqueeze(1), heads)
        return self._padded_rows

    def window_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([Tm] sequence, [Tm] query slot) of every window token: the indices that gather
        the real rows out of SDPA's padded [B, H, Qmax, d] output (`unpad_queries`); made
        once per forward."""
        if self._window_rows is None:
            q_max = self.q_index.shape[1]
            seq = torch.div(self.out_index, q_max, rounding_mode="floor")
            self._window_rows = (seq, self.out_index.remainder(q_max))
        return self._window_rows

    def visible(self, seqs: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[N, Kmax] bool: the key columns that window row `rows[n]` (a flat token) of sequence
        `seqs[n]` sees. The one visibility rule of the module docstring; `rows=None` gives the
        columns every row of the sequence may see (its real keys)."""
        valid = self.key_valid.index_select(0, seqs)
        if self.row_limit is None or rows is None:
            return valid
        cols = torch.arange(valid.shape[1], device=valid.device)
        return valid & (cols[None, :] < self.row_limit.index_select(0, rows)[:, None])

    def override_visible(self) -> torch.Tensor:
        """[S] bool: whether each override's predictor row sees its seed's column at all (a
        block-causal row never sees a later block, in either view)."""
        return self.visible(self.ov_seq, self.ov_row).gather(1, self.ov_col[:, None])[:, 0]

    def mask(self) -> torch.Tensor | None:
        """[B, 1, Qmax or 1, Kmax] bool visibility of the padded query rows (1 row when no
        sequence bounds its rows), or None when every row sees every column. Built once per
        forward (every layer reads it)."""
        if self._mask is None:
            self._mask = (self._build_mask(),)
        return self._mask[0]

    def _build_mask(self) -> torch.Tensor | None:
        if self.all_keys_valid:
            return None
        if self.row_limit is None:
            return self.key_valid[:, None, None, :]
        b, q_max = self.q_index.shape
        seqs = torch.arange(b, device=self.q_index.device).repeat_interleave(q_max)
        rows = self.q_index.flatten()
        allowed = self.visible(seqs, rows).view(b, 1, q_max, -1)
        pad = torch.ones(b * q_max, dtype=torch.bool, device=rows.device)
        pad[self.out_index] = False     # padded rows see their sequence's keys (output dropped;
        # never the padding columns, so the columns any row sees are the sequence's own:
        # layers/batch_invariant.py packs those)
        return allowed | (pad.view(b, 1, q_max, 1) & self.key_valid[:, None, None, :])

    def key_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """`mask()` as an additive bias (0 visible, -inf hidden), built once per dtype; zeros
        [B, 1, 1, Kmax] when nothing is hidden."""
        if self._key_bias is None or self._key_bias.dtype != dtype:
            allowed = self.mask()
            if allowed is None:
                allowed = self.key_valid[:, None, None, :]
            bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            self._key_bias = bias.masked_fill(~allowed, float("-inf"))
        return self._key_bias

    def override_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [B, 1, Qmax, Kmax + Smax] for attending over the keys followed by each
        sequence's overridden positions' fresh K/V (`ov_fresh`): every row sees its visible keys
        (the cached K/V at an override position) except that a predictor row sees, instead of
        its seed's cached column, that seed's fresh column. Built once per forward, from
        `override_hidden` (two ops where the host built it: `build_metadata`)."""
        if self._override_bias is None or self._override_bias.dtype != dtype:
            hidden = self.override_hidden
            if hidden is None:
                hidden = ~self.override_allowed()
            bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
            self._override_bias = bias.masked_fill_(hidden, float("-inf"))
        return self._override_bias

    def override_allowed(self) -> torch.Tensor:
        """[B, 1, Qmax, Kmax + Smax] bool: the columns each padded query row sees in the
        `mask` override mode (`override_bias`); a layout-only function of the metadata, so
        the host builds it with the rest (`build_metadata`: `override_hidden`)."""
        (b, q_max), k_max = self.q_index.shape, self.key_valid.shape[1]
        allowed = torch.zeros(b, q_max, k_max + self.ov_fresh.shape[1], dtype=torch.bool,
                              device=self.key_valid.device)
        visible = self._build_mask()        # uncached: the host's must not reach the device
        allowed[:, :, :k_max] = True if visible is None else visible[:, 0]
        sees_seed = allowed[self.ov_seq, self.ov_slot, self.ov_col]   # [S] (block rule)
        allowed[self.ov_seq, self.ov_slot, self.ov_col] = False
        allowed[self.ov_seq, self.ov_slot, k_max + self.ov_extra] = sees_seed
        return allowed[:, None]


def pad_queries(q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Window rows of the flat q [T, H, d] -> padded per sequence in SDPA's layout
    [B, H, Qmax, d]: a view when every window is full length, else one gather that lands in
    that layout (`AttentionMetadata.padded_rows`; a row gather and a transpose were two ops)."""
    b, q_max = meta.q_index.shape
    if meta.dense_queries:
        return heads_first(q, b, q_max)           # q holds the window rows only (`attend`)
    return q[meta.padded_rows(q.shape[1])]


def unpad_queries(o: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """SDPA's output [B, H, Qmax, d] -> the window rows on the flat axis, heads side by side
    [Tm, H * d]. Every window full length: one view where the kernel laid the output out as
    [B, Qmax, H, d] (torch's CPU flash kernel does, for this q), else a transpose and a reshape
    (the meta device's output is [B, H, Qmax, d]: a copy).
    Otherwise one gather of the real rows (`AttentionMetadata.window_rows`), which lands them
    as [Tm, H, d], and a view (a transpose, a reshape and a row gather before, issue #50)."""
    b, heads, q_max, d = o.shape
    if meta.dense_queries:
        if o.stride() == (q_max * heads * d, d, heads * d, 1):
            return o.as_strided((b * q_max, heads * d), (heads * d, 1), o.storage_offset())
        return o.transpose(1, 2).reshape(b * q_max, heads * d)
    seq, slot = meta.window_rows()
    rows = o[seq, :, slot]                                              # [Tm, H, d]
    return rows.view(rows.shape[0], heads * d)


class AttentionBackend(ABC):
    """Writes the window's fresh K/V in place, then attends over each sequence's paged canvas;
    extra rows (never written) attend separately under their allowed mask."""

    name: str

    def fresh_columns(self) -> bool:
        """Whether `attend` takes the override sources' fresh K/V as key columns after the
        canvas keys ([B, Kmax + Smax], `AttentionMetadata.override_bias`)."""
        return False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                return_keys: bool = False):
        """q [T, H, d], k/v [T, Hkv, d] (rotated), or k = K and V side by side [T, 2 Hkv, d]
        and v None (layers/base.py AttentionFn); cache = (k_cache, v_cache) [slots, Hkv, d] (a
        `LayerKV`, whose halves share one tensor, or any pair). Returns o [T, H * d], or
        (o, keys) with the gathered keys [B, Kmax, Hkv, d] the window rows attended over (for
        statistics that need them). With a scratch region (`meta.store_slots`) the seeds' fresh
        K/V are written to their scratch slots, and a backend that takes them as key columns
        gathers them with the canvas keys. Side-by-side K and V into a `LayerKV` are written
        by one op, and split only where a path reads them apart (`_reads_fresh_kv`)."""
        kv = k if v is None else None
        if kv is None or getattr(cache, "joint", None) is None:
            if kv is not None:
                k, v = kv_halves(kv)
            self._write(zip(cache, (k, v)), meta)
        else:
            self._write([(cache.joint, kv)], meta)
            k, v = kv_halves(kv) if self._reads_fresh_kv(meta) else (None, None)
        t = meta.num_window_tokens
        qw, kw, vw = (q, k, v) if meta.num_extra == 0 else (q[:t], k[:t], v[:t])   # window rows
        if meta.keys_are_window and cache[0].dtype == q.dtype:     # what the gather would read
            keys, values = window_kv(kv, k, v, meta.key_slots.shape)
        else:
            if meta.fresh_key_slots is not None and self.fresh_columns():
                slots, flat = meta.fresh_key_slots, meta.flat_fresh_key_slots
            else:
                slots, flat = meta.key_slots, meta.flat_key_slots
            keys, values = gather_kv(cache, slots, flat)     # [B, Hkv, Kmax (+ Smax), d]
        if meta.num_extra == 0:
            o = self.attend(q, k, v, keys, values, meta)
        else:
            k_max = meta.key_slots.shape[1]
            o = torch.cat([self.attend(qw, kw, vw, keys, values, meta), self.attend_extra(
                q, k, v, keys[:, :, :k_max], values[:, :, :k_max], meta)])
        if not return_keys:
            return o
        b, heads, _, d = keys.shape                # [B, Kmax, Hkv, d]: one view, not two
        return o, keys.as_strided((b, meta.key_slots.shape[1], heads, d),
                                  (keys.stride(0), keys.stride(2), keys.stride(1),
                                   keys.stride(3)), keys.storage_offset())

    @staticmethod
    def _write(pairs, meta: AttentionMetadata) -> None:
        """Write the window's fresh rows of each (cache, fresh [T, ...]) pair in place: the
        seeds to their scratch slots (`store_slots`), or every written row to its slot."""
        t = meta.num_window_tokens
        for cache, fresh in pairs:
            window = fresh if meta.num_extra == 0 else fresh[:t]
            if meta.store_slots is not None:                # seeds to scratch: no select
                cache.index_copy_(0, meta.store_slots, window)
            else:
                new = window if meta.write_all else fresh.index_select(0, meta.write_index)
                cache.index_copy_(0, meta.write_slots, new)

    def _reads_fresh_kv(self, meta: AttentionMetadata) -> bool:
        """Whether `attend`/`attend_extra` read the fresh k and v themselves: extra rows, and
        overrides unless their fresh K/V come gathered from scratch as key columns."""
        if meta.num_extra:
            return True
        return bool(meta.num_overrides) and not (self.fresh_columns()
                                                 and meta.fresh_key_slots is not None)

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Window rows' attention over gathered keys/values [B, Hkv, Kmax, d] (with
        `fresh_columns()` and a scratch region: [B, Hkv, Kmax + Smax, d], the seeds' fresh K/V
        last) with the override views. q/k/v hold the window tokens only ([Tm, ...]; None when
        `_reads_fresh_kv` says no path reads them). Returns [Tm, H * d]."""

    @abstractmethod
    def attend_extra(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Extra rows' attention: keys = the canvas [B, Hkv, Kmax, d] then the extra rows' own
        fresh K/V, masked by `meta.ex_allowed`. q/k/v are the whole flat axis. Returns
        [Te, H * d]."""

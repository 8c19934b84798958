"""Attention contract of the engine: batch layout metadata and the backend interface.

A batch holds several sequences. Each contributes a *window* of query tokens (contiguous canvas
positions) laid out back to back as the flat token axis [T]. Every sequence attends over its whole
canvas, positions 0..L-1, read from the paged KV cache after the window's fresh K/V have been
written in place. *Override* pairs (s, r) implement COVER's two views (ALGORITHMS.md §1.4): the
fresh K/V of position s are NOT written, so every query reads the cached (visible-token) K/V at s,
except predictor row r = π(s), which sees the fresh (masked-input) K/V of s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class SeqLayout:
    """One sequence of a batch, as the model runner describes it."""

    window_start: int             # first query position
    window_len: int               # number of query positions
    key_slots: torch.Tensor       # [L] cache slot of canvas positions 0..L-1
    override: list[tuple[int, int]]   # (position s, predictor row position r); both in window
    hidden_keys: torch.Tensor | None = None   # [L] bool, True = key hidden from every query


@dataclass
class AttentionMetadata:
    """Index tensors shared by all layers of one forward. T = tokens, B = sequences, S = overrides."""

    write_index: torch.Tensor    # [Tw] flat tokens whose fresh K/V are written to the cache
    write_slots: torch.Tensor    # [Tw] their cache slots
    q_index: torch.Tensor        # [B, Qmax] flat token of each padded query row (pad -> 0)
    out_index: torch.Tensor      # [T] position of each flat token in the [B * Qmax] padded layout
    key_slots: torch.Tensor      # [B, Kmax] cache slot of each key column (pad -> 0)
    key_valid: torch.Tensor      # [B, Kmax] bool
    ov_src: torch.Tensor         # [S] flat token of override position s (fresh K/V source)
    ov_row: torch.Tensor         # [S] flat token of its predictor row r
    ov_seq: torch.Tensor         # [S] sequence index
    ov_col: torch.Tensor         # [S] key column of s (= its canvas position)

    @property
    def num_overrides(self) -> int:
        return int(self.ov_src.numel())


def build_metadata(seqs: list[SeqLayout], device: torch.device | str = "cpu") -> AttentionMetadata:
    """Lay out a batch (one Python pass over sequences per step, shared by every layer)."""
    q_max = max(s.window_len for s in seqs)
    k_max = max(int(s.key_slots.numel()) for s in seqs)
    b = len(seqs)
    q_index = torch.zeros(b, q_max, dtype=torch.long)
    key_slots = torch.zeros(b, k_max, dtype=torch.long)
    key_valid = torch.zeros(b, k_max, dtype=torch.bool)
    out_index, write_index, write_slots = [], [], []
    ov_src, ov_row, ov_seq, ov_col = [], [], [], []
    offset = 0
    for i, s in enumerate(seqs):
        n, length = s.window_len, int(s.key_slots.numel())
        flat = torch.arange(offset, offset + n)
        q_index[i, :n] = flat
        out_index.append(torch.arange(i * q_max, i * q_max + n))
        key_slots[i, :length] = s.key_slots
        key_valid[i, :length] = True if s.hidden_keys is None else ~s.hidden_keys
        keep = torch.ones(n, dtype=torch.bool)
        for pos, row in s.override:
            keep[pos - s.window_start] = False
            ov_src.append(offset + pos - s.window_start)
            ov_row.append(offset + row - s.window_start)
            ov_seq.append(i)
            ov_col.append(pos)
        write_index.append(flat[keep])
        write_slots.append(s.key_slots[s.window_start:s.window_start + n][keep])
        offset += n
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return AttentionMetadata(
        write_index=torch.cat(write_index).to(device), write_slots=torch.cat(write_slots).to(device),
        q_index=q_index.to(device), out_index=torch.cat(out_index).to(device),
        key_slots=key_slots.to(device), key_valid=key_valid.to(device),
        ov_src=as_long(ov_src), ov_row=as_long(ov_row), ov_seq=as_long(ov_seq),
        ov_col=as_long(ov_col))


class AttentionBackend(ABC):
    """Writes the window's fresh K/V in place, then attends over each sequence's paged canvas."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, d], k/v [T, Hkv, d] (rotated); cache = (k_cache, v_cache) [slots, Hkv, d].
        Returns o [T, H, d]."""
        k_cache, v_cache = cache
        k_cache.index_copy_(0, meta.write_slots, k.index_select(0, meta.write_index))
        v_cache.index_copy_(0, meta.write_slots, v.index_select(0, meta.write_index))
        keys = k_cache[meta.key_slots]       # [B, Kmax, Hkv, d]
        values = v_cache[meta.key_slots]
        return self.attend(q, k, v, keys, values, meta)

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over gathered keys/values [B, Kmax, Hkv, d] with the override views."""

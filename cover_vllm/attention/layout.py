"""build_metadata: a batch's `SeqLayout`s -> the `AttentionMetadata` every layer shares (#43).

The layout is built with a fixed number of tensor ops over the whole batch, whatever its size:
one host tensor holds every sequence's integers (window start and length, key count, flat
offset, block size), the padded [B, Qmax] / [B, Kmax] index tensors come from broadcasting them
against one `arange`, and the per-sequence tensors (key slots, sparse window positions, hidden
keys) are concatenated once and scattered into their padded rows. Only the extra rows (WINO's
shadow block) are still copied per sequence that has them. The per-sequence loop this replaced
is the reference of tests/test_layout.py, which checks every field against it.
"""

from __future__ import annotations

import dataclasses

import torch

from cover_vllm.attention.base import AttentionMetadata, SeqLayout
from cover_vllm.host_transfer import to_device


def build_metadata(seqs: list[SeqLayout], device: torch.device | str = "cpu",
                   scratch: tuple[int, int] | None = None) -> AttentionMetadata:
    """Lay out a batch (a handful of host tensor ops per step, shared by every layer).
    `scratch` = (first slot, slots) of the cache's scratch region (worker/kv_cache.py): when the
    step's overrides fit, override j's fresh K/V go to scratch slot first + j (`store_slots`,
    `fresh_key_slots`), so no layer selects or concatenates them."""
    n = [s.window_len for s in seqs]
    lengths = [int(s.key_slots.numel()) for s in seqs]
    b, q_max, k_max, total = len(seqs), max(n), max(lengths), sum(n)
    offsets = _cumsum(n)
    ints = torch.tensor([(s.window_start, w, length, off, s.causal_block or 0)
                         for s, w, length, off in zip(seqs, n, lengths, offsets)],
                        dtype=torch.long)
    start, num_q, num_k, off, block = ints.t()[:, :, None]        # each [B, 1]
    cols_q, cols_k = torch.arange(q_max), torch.arange(k_max)
    q_valid = cols_q < num_q                                       # [B, Qmax]
    k_valid = cols_k < num_k                                       # [B, Kmax]
    flat = off + cols_q                                            # [B, Qmax] flat token
    pos = _window_positions(seqs, start + cols_q, q_valid)         # [B, Qmax] canvas position
    key_slots = torch.zeros(b, k_max, dtype=torch.long).masked_scatter_(
        k_valid, torch.cat([s.key_slots for s in seqs]))
    key_valid = _key_valid(seqs, k_valid, lengths)
    ov, ov_fresh_width = _override_table(seqs)                     # [S, 4], most per sequence
    ov_seq, ov_col, ov_rpos, ov_extra = ov.t()
    seq_pos = pos.index_select(0, ov_seq)                          # [S, Qmax]
    src_slot = (seq_pos == ov_col[:, None]).long().argmax(1)       # window row of s
    ov_slot = (seq_pos == ov_rpos[:, None]).long().argmax(1)       # window row of r = π(s)
    ov_off = off[:, 0].index_select(0, ov_seq)
    ov_src, ov_row = ov_off + src_slot, ov_off + ov_slot
    write = q_valid.clone()
    write[ov_seq, src_slot] = False                                # overrides keep old K/V
    slots = key_slots.gather(1, pos.clamp(0, k_max - 1))           # [B, Qmax] slot of each row
    write_index, write_slots = flat[write], slots[write]
    row_limit = _row_limit(seqs, pos, q_valid, (block, num_k, k_max))
    ov_fresh = torch.zeros(b, ov_fresh_width, dtype=torch.long)
    ov_fresh[ov_seq, ov_extra] = ov_src
    ex_index, ex_out, ex_allowed = _extra_layout(seqs, key_valid, total)
    store_slots, fresh_key_slots = _scratch_slots(slots, key_slots, ov, (src_slot, q_valid),
                                                  (scratch, ov_fresh_width))
    meta = AttentionMetadata(
        write_index=write_index, write_slots=write_slots,
        q_index=flat.masked_fill(~q_valid, 0),
        out_index=(torch.arange(b)[:, None] * q_max + cols_q)[q_valid],
        key_slots=key_slots, key_valid=key_valid,
        ov_src=ov_src, ov_row=ov_row, ov_seq=ov_seq, ov_col=ov_col, ov_key=ov_seq * k_max + ov_col,
        ov_slot=ov_slot, ov_extra=ov_extra, ov_fresh=ov_fresh, num_overrides=int(ov.shape[0]),
        ex_index=ex_index, ex_out=ex_out, ex_allowed=ex_allowed,
        write_all=int(write_index.numel()) == total, dense_queries=total == b * q_max,
        all_keys_valid=row_limit is None and bool(key_valid.all()),
        row_limit=row_limit, store_slots=store_slots, fresh_key_slots=fresh_key_slots,
        fresh_key_slots_flat=None if fresh_key_slots is None else fresh_key_slots.reshape(-1),
        keys_are_window=row_limit is None and _keys_are_window(seqs, lengths))
    if meta.num_overrides:      # host-built: one view of the step's copy where the device
        meta.override_hidden = ~meta.override_allowed()     # would take fifteen ops (#50)
    return move_to(device, meta)[0]


def _keys_are_window(seqs: list[SeqLayout], lengths: list[int]) -> bool:
    """Whether every sequence's window is its whole canvas, in order, with nothing overridden,
    hidden or extra, and all canvases have one length: the keys are the window's own K/V."""
    return len(set(lengths)) == 1 and all(
        s.window_start == 0 and s.window_len == length and s.positions is None
        and not s.override and s.hidden_keys is None and s.extra_allowed is None
        for s, length in zip(seqs, lengths))


def move_to(device: torch.device | str, meta: AttentionMetadata,
            *carry: torch.Tensor | None) -> tuple[AttentionMetadata, list[torch.Tensor | None]]:
    """A host-built `meta` on `device`, with `carry` (the step's other integer inputs: token
    ids, positions, logit rows; None stays None) in the same single copy (issue #43):
    host_transfer.to_device, one int64 buffer for every int64 and bool tensor, views on the
    device. On the CPU nothing is copied."""
    if torch.device(device).type == "cpu":
        return meta, list(carry)
    fields = [f.name for f in dataclasses.fields(meta)
              if isinstance(getattr(meta, f.name), torch.Tensor) and not f.name.startswith("_")]
    moved = to_device([getattr(meta, name) for name in fields] + list(carry),
                      torch.device(device))
    return dataclasses.replace(meta, **dict(zip(fields, moved))), moved[len(fields):]


def _scratch_slots(slots: torch.Tensor, key_slots: torch.Tensor, ov: torch.Tensor,
                   rows: tuple, region: tuple) -> tuple:
    """(`store_slots` [Tm], `fresh_key_slots` [B, Kmax + Smax]) when the step has overrides and
    they fit the scratch region, else (None, None). `slots` [B, Qmax] = each window row's cache
    slot; `rows` = ([S] window row of each seed, [B, Qmax] valid rows); `region` = ((first slot,
    slots) or None, Smax)."""
    (src_slot, q_valid), (scratch, width) = rows, region
    num = int(ov.shape[0])
    if scratch is None or num == 0 or num > scratch[1]:
        return None, None
    ov_seq, ov_extra = ov[:, 0], ov[:, 3]
    mine = scratch[0] + torch.arange(num)                         # [S] scratch slot of each seed
    store = slots.clone()
    store[ov_seq, src_slot] = mine
    fresh = torch.zeros(key_slots.shape[0], width, dtype=torch.long)  # pad -> slot 0 (masked)
    fresh[ov_seq, ov_extra] = mine
    return store[q_valid], torch.cat((key_slots, fresh), 1)


def _cumsum(values: list[int]) -> list[int]:
    """Exclusive prefix sums of `values` (Python ints)."""
    out, acc = [], 0
    for v in values:
        out.append(acc)
        acc += v
    return out


def _window_positions(seqs: list[SeqLayout], contiguous: torch.Tensor,
                      q_valid: torch.Tensor) -> torch.Tensor:
    """[B, Qmax] canvas position of every query row: window_start + row, except the rows of
    sparse windows, which take their `positions` (one scatter for all of them)."""
    sparse = [i for i, s in enumerate(seqs) if s.positions is not None]
    if not sparse:
        return contiguous
    rows = torch.zeros(len(seqs), 1, dtype=torch.bool)
    rows[sparse] = True
    return contiguous.masked_scatter(rows & q_valid,
                                     torch.cat([seqs[i].positions for i in sparse]))


def _key_valid(seqs: list[SeqLayout], k_valid: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[B, Kmax] bool: real keys (not padding) that no sequence hides."""
    if all(s.hidden_keys is None for s in seqs):
        return k_valid
    hidden = [torch.zeros(length, dtype=torch.bool) if s.hidden_keys is None else s.hidden_keys
              for s, length in zip(seqs, lengths)]
    return k_valid.masked_scatter(k_valid, ~torch.cat(hidden))


def _override_table(seqs: list[SeqLayout]) -> tuple[torch.Tensor, int]:
    """[S, 4] (sequence, position s, predictor row position r, rank within the sequence) of
    every override, sequence by sequence; and the most overrides of one sequence."""
    table = [(i, pos, row, e) for i, s in enumerate(seqs)
             for e, (pos, row) in enumerate(s.override)]
    width = max(len(s.override) for s in seqs)
    return torch.tensor(table, dtype=torch.long).reshape(-1, 4), width


def _row_limit(seqs: list[SeqLayout], pos: torch.Tensor, q_valid: torch.Tensor,
               geometry: tuple) -> torch.Tensor | None:
    """[Tm] exclusive key bound of each window token (block-causal), or None when every row of
    every sequence sees all of its keys. `geometry` = ([B, 1] block size, 0 for full
    attention; [B, 1] key count; Kmax)."""
    if all(s.causal_block is None for s in seqs):
        return None
    block, num_k, k_max = geometry
    causal = block > 0
    size = torch.where(causal, block, 1)
    limit = torch.minimum((pos // size + 1) * size, num_k)          # [B, Qmax]
    commit = torch.tensor([s.causal_commit for s in seqs])[:, None]
    if bool(commit.any()):              # rows before the window's last block: causal
        last = pos.masked_fill(~q_valid, -1).amax(1, keepdim=True) // size * size
        limit = torch.where(commit & (pos < last), pos + 1, limit)
    free = ((limit >= num_k) | ~q_valid).all(1, keepdim=True) | ~causal   # [B, 1]
    if bool(free.all()):
        return None
    return limit.masked_fill(free, k_max)[q_valid]


def _extra_layout(seqs: list[SeqLayout], key_valid: torch.Tensor, offset: int):
    """Index tensors of the extra rows; they follow all windows on the flat axis from `offset`.
    A few ops per distinct mask shape, not per sequence: the sequences whose [E, L + E] masks
    have one shape (usually all of them) are stacked and copied into the padded
    [B, Emax, Kmax + Emax] mask at once (tests/test_layout.py: the per-sequence loop)."""
    counts = [0 if s.extra_allowed is None else int(s.extra_allowed.shape[0]) for s in seqs]
    b, k_max, e_max = len(seqs), key_valid.shape[1], max(counts)
    if e_max == 0:
        empty = torch.zeros(b, 0, dtype=torch.long)
        return empty, torch.zeros(0, dtype=torch.long), torch.zeros(b, 0, k_max, dtype=torch.bool)
    num = torch.tensor(counts)                                   # [B]
    rows = torch.arange(e_max)
    real = rows < num[:, None]                                   # [B, Emax]
    ex_allowed = torch.zeros(b, e_max, k_max + e_max, dtype=torch.bool)
    ex_allowed[:, :, 0] = ~real                 # padded rows see one key; their output is dropped
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(seqs):
        if counts[i]:
            assert s.extra_allowed.shape == (counts[i], s.key_slots.numel() + counts[i]), \
                "extra_allowed must be [E, L + E]"
            shapes.setdefault(tuple(s.extra_allowed.shape), []).append(i)
    for (e, width), members in shapes.items():
        length, idx = width - e, torch.tensor(members)
        masks = torch.stack([seqs[i].extra_allowed for i in members])   # [S, E, L + E]
        ex_allowed[idx, :e, :length] = masks[:, :, :length] & key_valid[idx, None, :length]
        ex_allowed[idx, :e, k_max:k_max + e] = masks[:, :, length:]
    first = offset + torch.cumsum(num, 0) - num                  # each sequence's first row
    ex_index = (first[:, None] + rows).masked_fill(~real, 0)
    return ex_index, real.reshape(-1).nonzero().flatten(), ex_allowed

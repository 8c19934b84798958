"""The batched `build_metadata` (attention/layout.py) against the per-sequence loop it replaced
(issue #43): every AttentionMetadata field equal on random batches that mix contiguous and
sparse windows, overrides (LLaDA's row s, Dream's row s - 1), block-causal and full sequences,
hidden keys and extra rows; and the host ops of a layout do not grow with the batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cover_vllm.attention.base import AttentionMetadata, SeqLayout
from cover_vllm.attention.layout import build_metadata
from cover_vllm.benchmarks.op_count import OpCounter


def reference_metadata(seqs: list[SeqLayout],
                       scratch: tuple[int, int] | None = None) -> AttentionMetadata:
    """The slow reference: one Python pass over the sequences (the code before #43); with a
    `scratch` region (first slot, slots) that holds every override, override j is stored at
    scratch slot first + j (#42)."""
    q_max = max(s.window_len for s in seqs)
    k_max = max(int(s.key_slots.numel()) for s in seqs)
    b = len(seqs)
    q_index = torch.zeros(b, q_max, dtype=torch.long)
    key_slots = torch.zeros(b, k_max, dtype=torch.long)
    key_valid = torch.zeros(b, k_max, dtype=torch.bool)
    out_index, write_index, write_slots, limits, overrides = [], [], [], [], []
    store, fresh_cols = [], []
    bounded, offset = False, 0
    for i, s in enumerate(seqs):
        n, length = s.window_len, int(s.key_slots.numel())
        flat = torch.arange(offset, offset + n)
        q_index[i, :n] = flat
        out_index.append(torch.arange(i * q_max, i * q_max + n))
        key_slots[i, :length] = s.key_slots
        key_valid[i, :length] = True if s.hidden_keys is None else ~s.hidden_keys
        limit = s.key_limits()
        limits.append(torch.full((n,), k_max, dtype=torch.long) if limit is None else limit)
        bounded = bounded or limit is not None
        slots = (s.key_slots[s.window_start:s.window_start + n] if s.positions is None
                 else s.key_slots[s.positions])
        store.append(slots.clone())
        fresh_cols.append([])
        if s.override:
            src = s.row_of([pos for pos, _ in s.override])
            for a in src:                          # override j = the j-th over all sequences
                j = len(overrides) + len(fresh_cols[-1])
                store[-1][a] = -1 - j              # resolved below, once S is known
                fresh_cols[-1].append(j)
            rows = s.row_of([row for _, row in s.override])
            overrides += [(i, offset + a, offset + r, r, pos, e)
                          for e, (a, r, (pos, _)) in enumerate(zip(src, rows, s.override))]
            keep = torch.ones(n, dtype=torch.bool)
            keep[src] = False
            flat, slots = flat[keep], slots[keep]
        write_index.append(flat)
        write_slots.append(slots)
        offset += n
    ex_index, ex_out, ex_allowed = _reference_extra(seqs, key_valid, offset)
    num_written = sum(int(w.numel()) for w in write_index)
    ov = torch.tensor(overrides, dtype=torch.long).reshape(-1, 6)
    ov_seq, ov_src, ov_row, ov_slot, ov_col, ov_extra = ov.unbind(1)
    ov_fresh = torch.zeros(b, max(len(s.override) for s in seqs), dtype=torch.long)
    ov_fresh[ov_seq, ov_extra] = ov_src
    store_slots = fresh_key_slots = None
    if scratch is not None and 0 < len(overrides) <= scratch[1]:
        store_slots = torch.cat(store)
        store_slots = torch.where(store_slots < 0, scratch[0] - 1 - store_slots, store_slots)
        fresh_key_slots = torch.cat([key_slots, torch.zeros_like(ov_fresh)], 1)
        for i, cols in enumerate(fresh_cols):
            for e, j in enumerate(cols):
                fresh_key_slots[i, k_max + e] = scratch[0] + j
    meta = AttentionMetadata(
        write_index=torch.cat(write_index), write_slots=torch.cat(write_slots),
        q_index=q_index, out_index=torch.cat(out_index), key_slots=key_slots,
        key_valid=key_valid, ov_src=ov_src, ov_row=ov_row, ov_seq=ov_seq, ov_col=ov_col,
        ov_key=ov_seq * k_max + ov_col, ov_slot=ov_slot, ov_extra=ov_extra, ov_fresh=ov_fresh,
        num_overrides=len(overrides), ex_index=ex_index, ex_out=ex_out, ex_allowed=ex_allowed,
        write_all=num_written == offset, dense_queries=offset == b * q_max,
        all_keys_valid=bool(key_valid.all()) and not bounded,
        row_limit=torch.cat(limits) if bounded else None, store_slots=store_slots,
        fresh_key_slots=fresh_key_slots,
        fresh_key_slots_flat=None if fresh_key_slots is None else fresh_key_slots.reshape(-1),
        # every key column is the window token written to its slot, in order
        keys_are_window=(not overrides and ex_out.numel() == 0 and num_written == offset
                         == b * k_max and bool(key_valid.all()) and not bounded
                         and torch.equal(torch.cat(write_slots), key_slots.reshape(-1))))
    if overrides:
        meta.override_hidden = _override_hidden_loop(meta)
    return meta


def _override_hidden_loop(meta: AttentionMetadata) -> torch.Tensor:
    """The columns each padded row does not see in the `mask` override mode, override by
    override: the visible keys, then each predictor row trades its seed's column for the seed's
    fresh one (as visible as the seed's column was)."""
    (b, q_max), k_max = meta.q_index.shape, meta.key_valid.shape[1]
    visible = meta.mask()
    allowed = torch.zeros(b, q_max, k_max + meta.ov_fresh.shape[1], dtype=torch.bool)
    allowed[:, :, :k_max] = True if visible is None else visible[:, 0]
    for seq, slot, col, extra in zip(meta.ov_seq.tolist(), meta.ov_slot.tolist(),
                                     meta.ov_col.tolist(), meta.ov_extra.tolist()):
        sees = bool(allowed[seq, slot, col])
        allowed[seq, slot, col] = False
        allowed[seq, slot, k_max + extra] = sees
    meta._mask = None
    return ~allowed[:, None]


def _reference_extra(seqs, key_valid, offset):
    counts = [0 if s.extra_allowed is None else int(s.extra_allowed.shape[0]) for s in seqs]
    b, k_max, e_max = len(seqs), key_valid.shape[1], max(counts)
    ex_index = torch.zeros(b, e_max, dtype=torch.long)
    ex_allowed = torch.zeros(b, e_max, k_max + e_max, dtype=torch.bool)
    ex_allowed[:, :, 0] = True
    ex_out = []
    for i, (s, e) in enumerate(zip(seqs, counts)):
        if e == 0:
            continue
        length = int(s.key_slots.numel())
        ex_index[i, :e] = torch.arange(offset, offset + e)
        ex_out.append(torch.arange(i * e_max, i * e_max + e))
        ex_allowed[i, :e] = False
        ex_allowed[i, :e, :length] = s.extra_allowed[:, :length] & key_valid[i, :length]
        ex_allowed[i, :e, k_max:k_max + e] = s.extra_allowed[:, length:]
        offset += e
    ex_out = torch.cat(ex_out) if ex_out else torch.zeros(0, dtype=torch.long)
    return ex_index, ex_out, ex_allowed


def _random_seq(gen: torch.Generator, shift: int, features: set[str]) -> SeqLayout:
    """One random sequence: canvas length, window (contiguous or sparse), overrides whose
    predictor row (s - shift) is in the window, a block size, hidden keys, extra rows."""
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    length = rand(4, 40)
    slots = torch.randperm(200, generator=gen)[:length]
    if "sparse" in features and rand(0, 2):
        pick = torch.rand(length, generator=gen) < 0.5
        pick[rand(0, length)] = True
        positions = pick.nonzero().flatten()
        start, n = int(positions[0]), int(positions.numel())
    else:
        positions, start = None, rand(0, length)
        n = rand(1, length - start + 1)
    rows = (torch.arange(start, start + n) if positions is None else positions).tolist()
    override = []
    if "override" in features:
        for p in rows:
            if (p - shift) in rows and rand(0, 3) == 0 and p - shift >= 0:
                override.append((p, p - shift))
    layout = SeqLayout(start, n, slots, override, positions=positions)
    if "block" in features and rand(0, 3):
        layout.causal_block = rand(2, 12)
    if "hidden" in features and rand(0, 2):
        layout.hidden_keys = torch.rand(length, generator=gen) < 0.2
    if "extra" in features and rand(0, 2):
        e = rand(1, 5)
        layout.extra_allowed = torch.rand(e, length + e, generator=gen) < 0.7
    return layout


def assert_same_metadata(got: AttentionMetadata, want: AttentionMetadata) -> None:
    for field in dataclasses.fields(AttentionMetadata):
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), field.name
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), field.name
        else:
            assert a == b, field.name


FEATURES = ["plain", "override", "sparse,override", "block,override", "hidden,extra",
            "sparse,block,override,hidden,extra"]


@pytest.mark.parametrize("scratch", [None, (200, 64), (200, 3)])
@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("shift", [0, 1])
def test_batched_layout_equals_the_per_sequence_loop(features, shift, scratch):
    """Also with a scratch region behind the 200 slots: roomy, and one that most batches with
    overrides overflow (those write the seeds the slow way: no `store_slots`)."""
    gen = torch.Generator().manual_seed(FEATURES.index(features) * 2 + shift)
    for _ in range(25):
        seqs = [_random_seq(gen, shift, set(features.split(",")))
                for _ in range(int(torch.randint(1, 7, (1,), generator=gen)))]
        assert_same_metadata(build_metadata(seqs, scratch=scratch),
                             reference_metadata(seqs, scratch))


def test_full_windows_and_one_block_causal_sequence_that_sees_everything():
    slots = torch.arange(16)
    seqs = [SeqLayout(0, 16, slots, []), SeqLayout(0, 16, slots + 16, [], causal_block=32)]
    meta = build_metadata(seqs)
    assert_same_metadata(meta, reference_metadata(seqs))
    assert meta.dense_queries and meta.write_all and meta.all_keys_valid and meta.row_limit is None


def _host_ops(num_seqs: int, scratch: tuple[int, int] | None) -> int:
    slots = [torch.arange(i * 96, i * 96 + 96) for i in range(num_seqs)]
    seqs = [SeqLayout(64, 32, s, [(70, 70), (75, 75)]) for s in slots]
    with OpCounter() as ops:
        build_metadata(seqs, scratch=scratch)
    return ops.num_host


@pytest.mark.parametrize("scratch", [None, (64 * 96, 128)])
def test_host_ops_of_a_layout_do_not_grow_with_the_batch(scratch):
    assert _host_ops(64, scratch) == _host_ops(1, scratch)

"""Paged attention with override positions: the SDPA fast path against the slow two-view oracle."""

import pytest
import torch
import torch.nn.functional as F

from cover_vllm.attention import build_metadata, get_backend
from cover_vllm.attention.base import SeqLayout

HEAD_DIM = 16


def _random_batch(num_heads, num_kv_heads, overrides, seed=0, page_size=4):
    """Sequences with shuffled page tables over one shared pool, pre-filled with stale K/V."""
    gen = torch.Generator().manual_seed(seed)
    specs = [(30, 10, 12), (17, 0, 17), (23, 15, 8)]   # (canvas len, window start, window len)
    num_pages = sum(-(-length // page_size) for length, _, _ in specs) + 3
    perm = torch.randperm(num_pages, generator=gen).tolist()
    k_cache = torch.randn(num_pages * page_size, num_kv_heads, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_pages * page_size, num_kv_heads, HEAD_DIM, generator=gen)
    seqs, used = [], 0
    for i, (length, start, n) in enumerate(specs):
        pages = perm[used:used + -(-length // page_size)]
        used += len(pages)
        pos = torch.arange(length)
        slots = torch.tensor(pages)[pos // page_size] * page_size + pos % page_size
        seqs.append(SeqLayout(start, n, slots, overrides[i] if i < len(overrides) else []))
    t = sum(s.window_len for s in seqs)
    q = torch.randn(t, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(t, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(t, num_kv_heads, HEAD_DIM, generator=gen)
    return seqs, q, k, v, (k_cache, v_cache)


def _run(backend, seqs, q, k, v, cache):
    cache = (cache[0].clone(), cache[1].clone())
    return get_backend(backend).forward(q, k, v, cache, build_metadata(seqs)), cache


OVERRIDES = [
    [(12, 12), (13, 13), (20, 20)],                 # LLaDA: row s, several seeds, adjacent
    [(5, 4), (6, 5), (9, 8)],                        # Dream: row s-1, adjacent seeds chain
    [(16, 16), (17, 16), (20, 19)],                  # one row corrected at two columns
]


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_override_matches_two_view_reference(heads):
    seqs, q, k, v, cache = _random_batch(*heads, OVERRIDES, seed=1)
    fast, fast_cache = _run("sdpa", seqs, q, k, v, cache)
    slow, slow_cache = _run("reference", seqs, q, k, v, cache)
    assert (fast - slow).abs().max().item() <= 1e-5
    assert torch.equal(fast_cache[0], slow_cache[0]) and torch.equal(fast_cache[1], slow_cache[1])


def test_override_positions_keep_their_cached_kv():
    seqs, q, k, v, cache = _random_batch(4, 2, OVERRIDES, seed=2)
    _, new_cache = _run("sdpa", seqs, q, k, v, cache)
    for s in seqs:
        for pos, _ in s.override:
            slot = s.key_slots[pos]
            assert torch.equal(new_cache[0][slot], cache[0][slot])


def test_override_changes_only_predictor_rows():
    seqs, q, k, v, cache = _random_batch(4, 2, OVERRIDES, seed=3)
    with_ov, _ = _run("sdpa", seqs, q, k, v, cache)
    # Same batch, but the override positions' cache already holds what they would read.
    plain = [SeqLayout(s.window_start, s.window_len, s.key_slots, []) for s in seqs]
    meta = build_metadata(seqs)
    rows = set(meta.ov_row.tolist())
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    no_ov, _ = _run("sdpa", plain, q, k, v, (k_cache, v_cache))
    # Rows that are not predictor rows still see the *cached* K/V at override columns, so compare
    # them with a run where fresh K/V were not written at those slots: reuse the override run.
    others = [i for i in range(q.shape[0]) if i not in rows]
    assert not torch.allclose(with_ov[others], no_ov[others])   # the cache override is visible
    dense = with_ov.clone()
    ref, _ = _run("reference", seqs, q, k, v, cache)
    assert torch.allclose(dense[others], ref[others], atol=1e-5)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_no_override_equals_plain_sdpa(heads):
    seqs, q, k, v, cache = _random_batch(*heads, [], seed=4)
    out, new_cache = _run("sdpa", seqs, q, k, v, cache)
    offset = 0
    for s in seqs:
        n = s.window_len
        keys = new_cache[0][s.key_slots].transpose(0, 1)[None]      # [1, Hkv, L, d]
        values = new_cache[1][s.key_slots].transpose(0, 1)[None]
        qs = q[offset:offset + n].transpose(0, 1)[None]
        expect = F.scaled_dot_product_attention(qs, keys, values, enable_gqa=heads[0] != heads[1])
        got = out[offset:offset + n]
        assert (got - expect[0].transpose(0, 1)).abs().max().item() <= 1e-6
        # fresh K/V landed in place at the window's slots
        win = s.key_slots[s.window_start:s.window_start + n]
        assert torch.equal(new_cache[0][win], k[offset:offset + n])
        offset += n

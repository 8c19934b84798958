"""Paged attention with override positions: the SDPA fast path against the slow two-view oracle."""

import pytest
import torch
import torch.nn.functional as F

from cover_vllm.attention import build_metadata, get_backend
from cover_vllm.attention.base import SeqLayout
from cover_vllm.attention.sdpa import SDPABackend

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


def _backend(name):
    """A registered backend, or "sdpa/<override mode>"."""
    if name.startswith("sdpa/"):
        return SDPABackend(override=name.split("/")[1])
    return get_backend(name)


def _run(backend, seqs, q, k, v, cache):
    """The backend's output per head [T, H, d] (it returns the heads side by side, [T, H * d])
    and the cache it wrote."""
    cache = (cache[0].clone(), cache[1].clone())
    out = _backend(backend).forward(q, k, v, cache, build_metadata(seqs))
    assert out.shape == (q.shape[0], q.shape[1] * q.shape[2])
    return out.view(q.shape), cache


# both ways the SDPA backend builds the override views (the default on CPU is "mask")
SDPA_OVERRIDE = ["sdpa/mask", "sdpa/closed_form"]


OVERRIDES = [
    [(12, 12), (13, 13), (20, 20)],                 # LLaDA: row s, several seeds, adjacent
    [(5, 4), (6, 5), (9, 8)],                        # Dream: row s-1, adjacent seeds chain
    [(16, 16), (17, 16), (20, 19)],                  # one row corrected at two columns
]


@pytest.mark.parametrize("fast_path", SDPA_OVERRIDE)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_override_matches_two_view_reference(heads, fast_path):
    seqs, q, k, v, cache = _random_batch(*heads, OVERRIDES, seed=1)
    fast, fast_cache = _run(fast_path, seqs, q, k, v, cache)
    slow, slow_cache = _run("reference", seqs, q, k, v, cache)
    assert (fast - slow).abs().max().item() <= 1e-5
    assert torch.equal(fast_cache[0], slow_cache[0]) and torch.equal(fast_cache[1], slow_cache[1])


def test_override_modes_agree_and_are_validated():
    seqs, q, k, v, cache = _random_batch(4, 2, OVERRIDES, seed=8)
    masked, _ = _run("sdpa/mask", seqs, q, k, v, cache)
    closed, _ = _run("sdpa/closed_form", seqs, q, k, v, cache)
    assert (masked - closed).abs().max().item() <= 1e-5
    default, _ = _run("sdpa", seqs, q, k, v, cache)          # auto: mask on CPU
    assert torch.equal(default, masked)
    with pytest.raises(ValueError, match="override='fused'.*closed_form"):
        SDPABackend(override="fused")


@pytest.mark.parametrize("fast_path", SDPA_OVERRIDE)
def test_override_positions_keep_their_cached_kv(fast_path):
    seqs, q, k, v, cache = _random_batch(4, 2, OVERRIDES, seed=2)
    _, new_cache = _run(fast_path, seqs, q, k, v, cache)
    for s in seqs:
        for pos, _ in s.override:
            slot = s.key_slots[pos]
            assert torch.equal(new_cache[0][slot], cache[0][slot])


@pytest.mark.parametrize("fast_path", SDPA_OVERRIDE)
def test_override_changes_only_predictor_rows(fast_path):
    seqs, q, k, v, cache = _random_batch(4, 2, OVERRIDES, seed=3)
    with_ov, _ = _run(fast_path, seqs, q, k, v, cache)
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


def _with_extra_rows(seqs, q, k, v, counts, seed):
    """Give sequence i `counts[i]` extra query rows with a random allowed mask (WINO-like: each
    hides one canvas column); their q/k/v follow every window on the flat axis."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s, e in zip(seqs, counts):
        if e == 0:
            out.append(s)
            continue
        length = int(s.key_slots.numel())
        allowed = torch.rand(e, length + e, generator=gen) < 0.8
        allowed[torch.arange(e), torch.randint(length, (e,), generator=gen)] = False
        allowed[:, length] = True                        # every row sees one extra key at least
        out.append(SeqLayout(s.window_start, s.window_len, s.key_slots, s.override,
                             extra_allowed=allowed))
    t = sum(counts)
    extra = [torch.randn(t, *x.shape[1:], generator=gen) for x in (q, k, v)]
    return out, *(torch.cat([x, y]) for x, y in zip((q, k, v), extra))


@pytest.mark.parametrize("fast_path", SDPA_OVERRIDE)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("overrides", [[], OVERRIDES], ids=["plain", "override"])
def test_extra_rows_match_reference_and_never_touch_the_cache(heads, overrides, fast_path):
    seqs, q, k, v, cache = _random_batch(*heads, overrides, seed=5)
    base, base_cache = _run(fast_path, seqs, q, k, v, cache)
    ext, q2, k2, v2 = _with_extra_rows(seqs, q, k, v, [5, 0, 3], seed=6)
    fast, fast_cache = _run(fast_path, ext, q2, k2, v2, cache)
    slow, slow_cache = _run("reference", ext, q2, k2, v2, cache)
    assert fast.shape == (q2.shape[0], *q.shape[1:])
    assert (fast - slow).abs().max().item() <= 1e-5
    t = q.shape[0]
    assert torch.equal(fast[:t], base)                  # window rows never see extra rows
    assert torch.equal(fast_cache[0], base_cache[0]) and torch.equal(fast_cache[1], base_cache[1])
    assert torch.equal(slow_cache[0], base_cache[0])


def test_extra_rows_follow_their_allowed_mask():
    """An extra row that may see exactly one canvas key and nothing else returns that value."""
    seqs, q, k, v, cache = _random_batch(4, 4, [], seed=7)
    length = int(seqs[0].key_slots.numel())
    allowed = torch.zeros(2, length + 2, dtype=torch.bool)
    allowed[0, 3] = True                                 # row 0: canvas column 3 only
    allowed[1, length + 0] = True                        # row 1: extra row 0's key only
    ext = [SeqLayout(seqs[0].window_start, seqs[0].window_len, seqs[0].key_slots, [],
                     extra_allowed=allowed)] + seqs[1:]
    extra_qkv = torch.randn(3, 2, 4, HEAD_DIM, generator=torch.Generator().manual_seed(8))
    q2, k2, v2 = (torch.cat([x, y]) for x, y in zip((q, k, v), extra_qkv))
    for backend in ("sdpa", "reference"):
        out, new_cache = _run(backend, ext, q2, k2, v2, cache)
        t = q.shape[0]
        assert torch.allclose(out[t], new_cache[1][seqs[0].key_slots[3]], atol=1e-6)
        assert torch.allclose(out[t + 1], v2[t], atol=1e-6)

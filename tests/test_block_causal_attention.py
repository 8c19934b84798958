"""Block-causal visibility (attention/base.py): every backend, COVER's override views and the
statistics layer read one rule, checked here against masks built from positions alone."""

import dataclasses

import pytest
import torch

from cover_vllm.attention import build_metadata
from cover_vllm.attention.correction import expand_kv_heads
from cover_vllm.worker.step_stats import attention_in_mass, select_rows
from test_attention import HEAD_DIM, OVERRIDES, SDPA_OVERRIDE, _random_batch, _run

BLOCK = 4


def _causal(seqs, block=BLOCK, which=(0, 1, 2)):
    return [dataclasses.replace(s, causal_block=block if i in which else None)
            for i, s in enumerate(seqs)]


def _explicit(seqs, q, k, v, cache, block):
    """Oracle from positions only: write the window's K/V, then each row attends over the
    canvas keys of blocks <= its own (float64, no metadata involved). No overrides."""
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    out, offset = torch.empty(q.shape, dtype=torch.float64), 0
    for s in seqs:
        n, rows = s.window_len, s.window_positions()
        slots = s.key_slots[rows]
        k_cache[slots], v_cache[slots] = k[offset:offset + n], v[offset:offset + n]
        offset += n
    offset = 0
    for s in seqs:
        n, length = s.window_len, int(s.key_slots.numel())
        keys = expand_kv_heads(k_cache[s.key_slots], q.shape[1]).double()    # [L, H, d]
        values = expand_kv_heads(v_cache[s.key_slots], q.shape[1]).double()
        qs = q[offset:offset + n].double()
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * HEAD_DIM ** -0.5
        pos = s.window_positions()
        limit = (pos // block + 1) * block if s.causal_block else torch.full_like(pos, length)
        hidden = torch.arange(length)[None, :] >= limit[:, None]
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[offset:offset + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        offset += n
    return out.float()


def test_visibility_is_the_block_rule():
    seqs, *_ = _random_batch(4, 2, [])
    meta = build_metadata(_causal(seqs, which=(0,)))
    assert meta.row_limit is not None and not meta.all_keys_valid
    mask = meta.mask()                                   # [B, 1, Qmax, Kmax]
    s = seqs[0]
    for row, pos in enumerate(s.window_positions().tolist()):
        want = torch.arange(mask.shape[-1]) < min((pos // BLOCK + 1) * BLOCK, 30)
        assert torch.equal(mask[0, 0, row], want)
    # a sequence whose every row sees every key needs no per-row bound
    whole = dataclasses.replace(seqs[1], causal_block=64)
    assert build_metadata([whole]).row_limit is None


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_backends_match_the_positional_oracle(backend, heads):
    seqs, q, k, v, cache = _random_batch(*heads, [])
    seqs = _causal(seqs, which=(0, 2))                   # a full-attention sequence beside them
    o, _ = _run(backend, seqs, q, k, v, cache)
    torch.testing.assert_close(o, _explicit(seqs, q, k, v, cache, BLOCK), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fast_path", SDPA_OVERRIDE)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_cover_override_matches_two_view_oracle_under_block_mask(heads, fast_path):
    """COVER's KV override and its closed-form diagonal correction under the block mask equal
    the reference backend's genuine second attention per predictor row."""
    seqs, q, k, v, cache = _random_batch(*heads, OVERRIDES)
    seqs = _causal(seqs)
    fast, fast_cache = _run(fast_path, seqs, q, k, v, cache)
    ref, ref_cache = _run("reference", seqs, q, k, v, cache)
    torch.testing.assert_close(fast, ref, atol=2e-5, rtol=1e-5)
    assert torch.equal(fast_cache[0], ref_cache[0])
    # the block mask does change the override rows (the test is not vacuous)
    full, _ = _run("reference", _causal(seqs, which=()), q, k, v, cache)
    assert (full - ref).abs().max() > 1e-3


def test_statistics_read_the_same_visibility():
    seqs, q, k, v, cache = _random_batch(4, 2, [])
    seqs = _causal(seqs)
    meta = build_metadata(seqs)
    rows = [torch.ones(s.window_len, dtype=torch.bool) for s in seqs]
    index, real = select_rows(rows)
    keys = torch.stack([torch.nn.functional.pad(cache[0][s.key_slots], (0, 0, 0, 0, 0, 30 - len(
        s.key_slots))) for s in seqs])
    mass = attention_in_mass(q, keys, meta, index, real)            # [B, Kmax]
    for b, s in enumerate(seqs):
        last = int(s.window_positions().max())
        hidden = (last // BLOCK + 1) * BLOCK
        assert float(mass[b, hidden:].abs().sum()) == 0.0           # no row sees past its block
        torch.testing.assert_close(mass[b].sum(), torch.tensor(float(s.window_len)))

"""The per-step statistics COVER's seed score reads, against explicit per-sequence formulas."""

import pytest
import torch

from cover_vllm.attention.base import SeqLayout
from cover_vllm.layers.kv_layout import gather_heads
from cover_vllm.attention.layout import build_metadata
from cover_vllm.worker.step_stats import attention_in_mass, key_drift, select_rows


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_attention_in_mass_is_the_mean_head_mass_from_the_selected_rows(heads):
    num_heads, num_kv, dim = *heads, 8
    gen = torch.Generator().manual_seed(0)
    # (canvas length, window start, window length): padding in both the query and key layouts
    specs = [(20, 4, 10), (13, 0, 13), (9, 6, 3)]
    offset, seqs = 0, []
    for length, start, n in specs:
        seqs.append(SeqLayout(start, n, torch.arange(offset, offset + length), []))
        offset += length
    meta = build_metadata(seqs)
    t = sum(n for _, _, n in specs)
    q = torch.randn(t, num_heads, dim, generator=gen)
    cache = torch.randn(offset, num_kv, dim, generator=gen)
    keys = gather_heads(cache, meta.key_slots).transpose(1, 2)      # [B, Kmax, Hkv, d]
    rows = torch.rand(t, generator=gen) < 0.5
    rows[t - 3:] = False                           # a sequence with no selected row: zero mass
    pieces = list(rows.split([n for _, _, n in specs]))
    got = attention_in_mass(q, keys, meta, *select_rows(pieces))     # [B, Kmax]
    flat = 0
    for i, (length, _, n) in enumerate(specs):
        k = cache[seqs[i].key_slots].repeat_interleave(num_heads // num_kv, dim=1)   # [L, H, d]
        scores = torch.einsum("qhd,khd->hqk", q[flat:flat + n].double(), k.double()) * dim ** -0.5
        probs = torch.softmax(scores, dim=-1)                        # [H, n, L]
        expect = probs[:, rows[flat:flat + n]].sum(1).mean(0)        # [L]
        assert torch.allclose(got[i, :length].double(), expect, atol=1e-5)
        assert torch.all(got[i, length:] == 0)                       # padded key columns
        flat += n


def test_key_drift_is_the_mean_relative_key_change():
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(5, 2, 8, generator=gen)
    new = old + 0.1 * torch.randn(5, 2, 8, generator=gen)
    expect = torch.stack([torch.stack([(new[p, h] - old[p, h]).norm() / old[p, h].norm()
                                       for h in range(2)]).mean() for p in range(5)])
    assert torch.allclose(key_drift(new, old), expect, atol=1e-5)
    assert torch.equal(key_drift(old, old), torch.zeros(5))

"""COVER's seeds written to scratch slots (issue #42): with a scratch region behind the pool,
every window token is written by one `index_copy_` (each seed to its scratch slot) and the `mask`
mode gathers the seeds' fresh K/V with the canvas keys. Same outputs, bit for bit, and the same
canvas cache as the path without scratch, for every backend and override mode; the slow two-view
oracle agrees."""

from __future__ import annotations

import pytest
import torch

from cover_vllm.attention import build_metadata
from tests.test_attention import OVERRIDES, _backend, _random_batch

BACKENDS = ["sdpa/mask", "sdpa/closed_form", "reference"]
SCRATCH = 16


def _with_scratch(cache):
    """The pool followed by SCRATCH slots of garbage (scratch holds nothing between steps)."""
    return tuple(torch.cat([c, torch.full((SCRATCH, *c.shape[1:]), 1e4)]) for c in cache)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_scratch_slots_change_nothing(backend, heads):
    seqs, q, k, v, cache = _random_batch(*heads, OVERRIDES, seed=5)
    num_slots = cache[0].shape[0]
    plain_cache = (cache[0].clone(), cache[1].clone())
    want, want_keys = _backend(backend).forward(q, k, v, plain_cache, build_metadata(seqs),
                                                return_keys=True)
    meta = build_metadata(seqs, scratch=(num_slots, SCRATCH))
    assert meta.store_slots is not None and meta.write_all is False
    big = _with_scratch(cache)
    got, got_keys = _backend(backend).forward(q, k, v, big, meta, return_keys=True)
    assert torch.equal(got, want) and torch.equal(got_keys, want_keys)
    for new, old in zip(big, plain_cache):
        assert torch.equal(new[:num_slots], old)                 # the canvas slots
    seeds = meta.store_slots[meta.store_slots >= num_slots]
    assert torch.equal(big[0][seeds], k[meta.ov_src])            # the seeds' fresh K


@pytest.mark.parametrize("heads", [(4, 2)])
def test_scratch_path_matches_the_two_view_oracle(heads):
    seqs, q, k, v, cache = _random_batch(*heads, OVERRIDES, seed=6)
    meta = build_metadata(seqs, scratch=(cache[0].shape[0], SCRATCH))
    fast = _backend("sdpa/mask").forward(q, k, v, _with_scratch(cache), meta)
    slow = _backend("reference").forward(q, k, v, (cache[0].clone(), cache[1].clone()),
                                         build_metadata(seqs))
    assert (fast - slow).abs().max().item() <= 1e-5


def test_too_many_overrides_write_the_slow_way():
    seqs, *_ = _random_batch(4, 2, OVERRIDES, seed=7)
    assert build_metadata(seqs, scratch=(10_000, 2)).store_slots is None
    assert build_metadata(seqs).store_slots is None


def test_the_engine_cache_has_the_planned_scratch_behind_its_pages():
    from cover_vllm import LLM
    llm = LLM("cover-tiny", num_threads=1, kv_cache_memory_bytes=8 << 20, max_num_seqs=4)
    plan, cache = llm.engine.memory, llm.engine.executor.runner.cache
    assert plan.scratch_slots == 4 * 16 and "64 scratch slots" in plan.startup_line()
    assert cache.scratch == (plan.num_pages * plan.page_size, plan.scratch_slots)
    assert cache.k[0].shape[0] == plan.num_pages * plan.page_size + plan.scratch_slots

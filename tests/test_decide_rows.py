"""The strategies' canvas rows (engine/decide.py `_canvas_rows`), built with a fixed number of
tensor ops per group, against the per-request loop they replaced (issue #43)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cover_vllm.benchmarks.op_count import OpCounter
from cover_vllm.engine.decide import _canvas_rows, _pad_stack

MASK = 99


def _reference(reqs, items, width):
    valid = torch.zeros(len(reqs), width, dtype=torch.bool)
    in_block, is_gen, seeds = (torch.zeros_like(valid) for _ in range(3))
    tokens = []
    for i, (req, item) in enumerate(zip(reqs, items)):
        if item.override:
            seeds[i, torch.tensor([s for s, _ in item.override]) - item.view_start] = True
        n = item.view_end - item.view_start
        pos = torch.arange(item.view_start, item.view_end)
        start, end = req.block
        valid[i, :n] = True
        in_block[i, :n] = (pos >= start) & (pos < end)
        is_gen[i, :n] = pos >= req.prompt_len
        tokens.append(req.canvas[item.view_start:item.view_end])
    return _pad_stack(tokens, width, MASK), valid, in_block, is_gen, seeds


def _random_group(gen: torch.Generator, size: int):
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    reqs, items = [], []
    for _ in range(size):
        prompt, length = rand(1, 20), rand(25, 60)
        canvas = torch.randint(0, 100, (length,), generator=gen)
        start = rand(prompt, length - 1)
        block = (start, min(length, start + rand(1, 16)))
        view_start = rand(0, start + 1)
        view_end = rand(block[0] + 1, length + 1)
        seeds = sorted({rand(view_start, view_end) for _ in range(rand(0, 4))})
        reqs.append(SimpleNamespace(canvas=canvas, canvas_len=length, block=block,
                                    prompt_len=prompt, mask_id=MASK))
        items.append(SimpleNamespace(view_start=view_start, view_end=view_end,
                                     override=[(s, s) for s in seeds]))
    return reqs, items


def test_batched_rows_equal_the_per_request_loop():
    gen = torch.Generator().manual_seed(0)
    for size in (1, 2, 5, 9) * 5:
        reqs, items = _random_group(gen, size)
        width = max(it.view_end - it.view_start for it in items)
        rows = _canvas_rows(reqs, items, width)
        want = _reference(reqs, items, width)
        got = rows.tokens, rows.valid, rows.in_block, rows.is_gen, rows.seeds
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_host_ops_of_the_rows_do_not_grow_with_the_group():
    def count(size):
        reqs, items = _random_group(torch.Generator().manual_seed(1), size)
        with OpCounter() as ops:
            _canvas_rows(reqs, items, max(it.view_end - it.view_start for it in items))
        return ops.num_host
    assert count(64) == count(2)

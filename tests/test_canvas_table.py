"""The persistent batch's canvas table (scheduler/canvas_table.py, issue #43): rows follow their
requests through growth and release, and one batched write equals each request writing its own
row (Request._write, the per-request path)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cover_vllm.scheduler.canvas_table import CanvasTable, DecisionWrites
from cover_vllm.step_plan import RowDecision


class _Req(SimpleNamespace):
    @property
    def canvas_len(self) -> int:
        return int(self.canvas.numel())


def _req(length: int, seed: int) -> _Req:
    return _Req(canvas=torch.randint(0, 50, (length,), generator=torch.Generator().manual_seed(
        seed)), slot=None)


def test_rows_are_views_that_survive_growth_and_release():
    table = CanvasTable(4)
    a, b = _req(5, 0), _req(7, 1)
    before = a.canvas.clone(), b.canvas.clone()
    table.attach([a, b])
    assert (a.slot, b.slot) == (0, 1) and torch.equal(a.canvas, before[0])
    a.canvas[2] = 99                                   # a write through the view lands in the row
    assert int(table.tokens[0, 2]) == 99
    c = _req(30, 2)
    table.attach([c])                                  # wider: the table grows, views re-pointed
    assert table.tokens.shape[1] >= 30 and torch.equal(b.canvas, before[1])
    assert int(a.canvas[2]) == 99 and a.canvas.data_ptr() == table.tokens[0].data_ptr()
    table.detach(a)
    assert a.slot is None and int(a.canvas[2]) == 99
    table.tokens[0].fill_(0)                           # the freed row no longer backs a's canvas
    assert int(a.canvas[2]) == 99
    d = _req(3, 3)
    table.attach([d])
    assert d.slot == 0                                 # the lowest free slot is reused


def test_one_batched_write_equals_each_request_writing_its_row():
    gen = torch.Generator().manual_seed(0)
    table = CanvasTable(6)
    reqs = [_req(int(torch.randint(10, 40, (1,), generator=gen)), i) for i in range(6)]
    table.attach(reqs)
    expect = [r.canvas.clone() for r in reqs]
    starts, rows = [], []
    for i, (r, want) in enumerate(zip(reqs, expect)):
        start = int(torch.randint(0, r.canvas_len - 4, (1,), generator=gen))
        width = int(torch.randint(1, r.canvas_len - start, (1,), generator=gen))
        commit = torch.rand(width, generator=gen) < 0.4
        replace = (torch.rand(width, generator=gen) < 0.2) & ~commit if i % 2 else None
        tokens = torch.randint(50, 90, (width,), generator=gen)
        rows.append(RowDecision(commit, tokens, None, replace, 0, 0))
        starts.append(start)
        written = replace if replace is not None else torch.zeros_like(commit)
        want[start:start + width][commit | written] = tokens[commit | written]
    writes = DecisionWrites(table, reqs, starts, rows)
    writes.write()
    for r, want, row in zip(reqs, expect, rows):
        assert torch.equal(r.canvas, want)
    assert writes.counts == [(int(d.commit.sum()), 0 if d.replace is None else
                              int(d.replace.sum())) for d in rows]

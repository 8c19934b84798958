"""The persistent batch's canvas table (scheduler/canvas_table.py, issue #43): rows follow their
requests through growth and release, and one batched write equals each request writing its own
row (Request._write, the per-request path)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cover_vllm.models.spec import ModelSpec
from cover_vllm.sampling_params import SamplingParams
from cover_vllm.scheduler.canvas_table import CanvasTable, DecisionWrites
from cover_vllm.scheduler.request import Request
from cover_vllm.step_plan import RowDecision
from cover_vllm.strategies import make_params, strategy_class


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


def _request(length: int, seed: int) -> Request:
    spec = ModelSpec(family="llada", vocab_size=100, mask_token_id=99, eos_token_ids=(98,),
                     pad_token_id=98, logit_shift=0, max_model_len=64)
    strategy = strategy_class("threshold")(make_params("threshold", None), spec)
    req = Request(f"r{seed}", None, [1, 2], SamplingParams(max_tokens=length - 2,
                  block_length=length - 2), strategy, torch.Generator(), "none")
    req.canvas = _req(length, seed).canvas
    return req


def test_one_batched_write_equals_each_request_writing_its_row():
    gen = torch.Generator().manual_seed(0)
    table = CanvasTable(6)
    reqs = [_request(int(torch.randint(10, 40, (1,), generator=gen)), i) for i in range(6)]
    alone = [_request(r.canvas_len, i) for i, r in enumerate(reqs)]    # outside the table
    table.attach(reqs)
    starts, rows = [], []
    for i, r in enumerate(reqs):
        start = int(torch.randint(0, r.canvas_len - 4, (1,), generator=gen))
        width = int(torch.randint(1, r.canvas_len - start, (1,), generator=gen))
        pick = torch.rand(width, generator=gen)
        commit = pick < 0.4
        replace = ((pick >= 0.4) & (pick < 0.6)) if i % 2 else None
        remask = (pick >= 0.8) if i % 3 else None
        tokens = torch.randint(50, 90, (width,), generator=gen)
        rows.append(RowDecision(commit, tokens, remask, replace, 0, 0))
        starts.append(start)
    for _ in range(2):                  # the second round commits over the first's remasks
        writes = DecisionWrites(table, reqs, starts, rows)
        assert any(w.remasked for w in writes.per_request)
        for req, a, start, d, written in zip(reqs, alone, starts, rows, writes.per_request):
            req.apply(start, d.commit, d.tokens, d.remask, d.replace, written)
            a.apply(start, d.commit, d.tokens, d.remask, d.replace)      # its own write
        writes.write()
        for r, a in zip(reqs, alone):
            assert torch.equal(r.canvas, a.canvas)
            assert r.remasked_from == a.remasked_from and r.metrics == a.metrics
        rows = [RowDecision(torch.zeros_like(d.commit) if d.remask is None else d.remask,
                            torch.randint(50, 90, d.tokens.shape, generator=gen),
                            d.commit, None, 0, 0) for d in rows]

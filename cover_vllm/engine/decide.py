"""Runs the strategies of one step: one vectorised `decide` call per strategy instance, then
per request its decision row: made grammar-valid for requests with structured outputs
(cover_vllm/structured_output/constraint.py), with the written tokens' logprobs when it asked
for them."""

from __future__ import annotations

import torch

from cover_vllm.engine.logprobs import attach_logprobs
from cover_vllm.scheduler.output import SchedulerOutput
from cover_vllm.scheduler.request import Request
from cover_vllm.step_plan import RowDecision
from cover_vllm.strategies.base import StepBatch
from cover_vllm.structured_output.constraint import (ViewRow, constrain_decision,
                                                      mask_frontiers, restore)


def _pad_stack(rows: list[torch.Tensor], width: int, fill) -> torch.Tensor:
    """[len_i, ...] rows -> [n, width, ...], padded with `fill` (a new tensor either way)."""
    if all(r.shape[0] == width for r in rows):
        return torch.stack(rows)
    out = torch.full((len(rows), width, *rows[0].shape[1:]), fill, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def _stack_logits(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per-request logits [len_i, V] -> [n, width, V]: a view, not a copy, when they are
    equal-length back-to-back slices of one tensor (the runner's split of its logits, the
    usual case: copying them cost 2.5 ms of a 16-request llada-50m step). The runner's logits
    belong to this step, so the caller may write into the result."""
    first = rows[0]
    step = first.numel()
    adjacent = first.shape[0] == width and first.is_contiguous() and all(
        r.shape == first.shape and r.is_contiguous()
        and r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and r.storage_offset() == first.storage_offset() + i * step
        for i, r in enumerate(rows))
    if not adjacent:
        return _pad_stack(rows, width, 0.0)
    return first.as_strided((len(rows), *first.shape), (step, *first.stride()),
                            first.storage_offset())


def _stat(rows: list[torch.Tensor | None] | None, width: int) -> torch.Tensor | None:
    if rows is None or any(r is None for r in rows):
        return None
    return _pad_stack(rows, width, 0.0)


def _extras(rows: list[torch.Tensor | None] | None) -> tuple[torch.Tensor | None, ...]:
    """Per-request extra-row logits ([E_i, V] or None) -> padded [n, E, V] and validity [n, E]."""
    if rows is None or all(r is None for r in rows):
        return None, None
    vocab = next(r for r in rows if r is not None).shape[-1]
    rows = [torch.zeros(0, vocab) if r is None else r for r in rows]
    width = max(r.shape[0] for r in rows)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        valid[i, : r.shape[0]] = True
    return _pad_stack(rows, width, 0.0), valid


def _batch(reqs: list[Request], items, logits: list[torch.Tensor], drift=None,
           attn_in=None, extra_logits=None) -> StepBatch:
    width = max(x.shape[0] for x in logits)
    valid = torch.zeros(len(reqs), width, dtype=torch.bool)
    in_block = torch.zeros_like(valid)
    is_gen = torch.zeros_like(valid)
    tokens = []
    seeds = torch.zeros_like(valid)
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
    params = [r.params for r in reqs]
    extra = _extras(extra_logits)
    padded = _stack_logits(logits, width)
    with torch.inference_mode():                   # the runner's logits are inference tensors
        padded[..., reqs[0].mask_id] = float("-inf")  # [MASK] is never a proposal (else: stuck)
    return StepBatch(
        logits=padded, tokens=_pad_stack(tokens, width, reqs[0].mask_id),
        valid=valid, in_block=in_block, is_gen=is_gen, states=[r.state for r in reqs],
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float64),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
        generators=[r.generator for r in reqs], mask_id=reqs[0].mask_id, seeds=seeds,
        drift=_stat(drift, width), attn_in=_stat(attn_in, width),
        extra_logits=extra[0], extra_valid=extra[1])


def run_strategies(out: SchedulerOutput, requests: dict[str, Request], result,
                   observers=()) -> dict[str, RowDecision]:
    """One `decide` per strategy instance over the ModelRunnerOutput `result`; each observer's
    `on_decide(strategy, batch)` is called just before it."""
    logits = result.logits
    groups: dict[int, list[int]] = {}
    for i, item in enumerate(out.items):
        groups.setdefault(id(requests[item.request_id].strategy), []).append(i)
    decisions = {}
    for idx in groups.values():
        items = [out.items[i] for i in idx]
        reqs = [requests[it.request_id] for it in items]
        stats = [None if result.drift is None else [getattr(result, f)[i] for i in idx]
                 for f in ("drift", "attn_in")]
        extra = None if result.extra_logits is None else [result.extra_logits[i] for i in idx]
        strategy = reqs[0].strategy
        batch = _batch(reqs, items, [logits[i] for i in idx], *stats, extra_logits=extra)
        for observer in observers:
            observer.on_decide(strategy, batch)
        saved = mask_frontiers([(r.grammar, batch.logits[row], _frontier_index(r, it))
                                for row, (r, it) in enumerate(zip(reqs, items)) if r.grammar])
        d = strategy.decide(batch)
        restore(saved)
        zeros = [0] * len(reqs)
        keeps = zeros if d.keeps is None else d.keeps.tolist()
        verified = zeros if d.verified is None else d.verified.tolist()
        stops = [False] * len(reqs) if d.stop is None else d.stop.tolist()
        for row, (req, item) in enumerate(zip(reqs, items)):
            n = item.view_end - item.view_start
            pick = lambda t: None if t is None else t[row, :n]  # noqa: E731
            decision = RowDecision(
                commit=d.commit[row, :n], tokens=d.tokens[row, :n], remask=pick(d.remask),
                replace=pick(d.replace), keeps=keeps[row], verified=verified[row],
                stop=bool(stops[row]))
            if req.grammar is not None:
                decision = constrain_decision(req.grammar, _view_row(batch, row, req, item),
                                              decision)
            # last: whatever edits the decision above, logprobs describe the tokens it writes
            if req.params.logprobs is not None:
                attach_logprobs(decision, batch.logits[row, :n], req.params.logprobs)
            decisions[req.request_id] = decision
    return decisions


def _frontier_index(req: Request, item) -> int:
    """The view index of the grammar's frontier when the next token there is still open."""
    f = req.grammar.frontier
    if item.view_start <= f < min(item.view_end, req.gen_end) and int(req.canvas[f]) == \
            req.mask_id:
        return f - item.view_start
    return -1


def _view_row(batch: StepBatch, row: int, req: Request, item) -> ViewRow:
    n = item.view_end - item.view_start
    if req.strategy.masked_rows_only:    # a sparse window computes masked rows and seeds only
        drawable = batch.masked[row, :n] | batch.seeds[row, :n]
    else:
        drawable = batch.valid[row, :n]
    return ViewRow(item.view_start, batch.tokens[row, :n], batch.logits[row, :n], drawable,
                   req.gen_end, req.mask_id, req.params.temperature, req.generator)

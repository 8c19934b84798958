"""Runs the strategies of one step on the logits' device and brings their decisions to the host
in one copy.

Per strategy instance, one vectorised `decide` over its requests' views, on the device where the
forward left the logits (vLLM's logits processors applied there first, for the requests that set
them: engine/logits_processors.py; then the structured-output frontier rows masked), then, for the
requests that asked, the written tokens' logprobs (also on the device). Every group's decision
tensors then cross to the host together (cover_vllm/host_transfer.py: one copy per step,
whatever the batch or the mix of strategies), where each strategy `absorb`s its decision (its own
bookkeeping) and each request gets its row: made grammar-valid for requests with structured
outputs (cover_vllm/structured_output/constraint.py), with its logprobs attached.

Structured outputs with logprobs: the constraint may change what a decision writes, so those
requests' logprobs are read after it, in one more copy (only in steps that have such requests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cover_vllm.engine.logits_processors import process_logits
from cover_vllm.engine.logprobs import attach_logprobs, logprob_rows
from cover_vllm.host_transfer import HostTransfer, to_device
from cover_vllm.scheduler.output import SchedulerOutput
from cover_vllm.scheduler.request import Request
from cover_vllm.step_plan import RowDecision
from cover_vllm.strategies.base import CanvasRows, Decision, StepBatch, Strategy
from cover_vllm.structured_output.constraint import (ViewRow, constrain_decision,
                                                      mask_frontiers, restore)


def _pad_stack(rows: list[torch.Tensor], width: int, fill) -> torch.Tensor:
    """[len_i, ...] rows -> [n, width, ...], padded with `fill` (a new tensor either way)."""
    if all(r.shape[0] == width for r in rows):
        return torch.stack(rows)
    out = torch.full((len(rows), width, *rows[0].shape[1:]), fill, dtype=rows[0].dtype,
                     device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def stack_logits(rows: list[torch.Tensor], width: int) -> torch.Tensor:
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


def _extras(rows: list[torch.Tensor | None] | None,
            device: torch.device) -> tuple[torch.Tensor | None, ...]:
    """Per-request extra-row logits ([E_i, V] or None) -> padded [n, E, V] (a view when they are
    equal back-to-back slices: `stack_logits`) and validity [n, E]."""
    if rows is None or all(r is None for r in rows):
        return None, None
    vocab = next(r for r in rows if r is not None).shape[-1]
    rows = [torch.zeros(0, vocab, device=device) if r is None else r for r in rows]
    lengths = [r.shape[0] for r in rows]
    width = max(lengths)
    valid = torch.arange(width) < torch.tensor(lengths)[:, None]
    return stack_logits(rows, width), to_device([valid], device)[0]


def _canvas_rows(reqs: list[Request], items, width: int) -> CanvasRows:
    """The views' canvas rows on the host, with a fixed number of tensor ops for the whole
    group: one table of each row's integers, broadcast against one `arange`, and one gather
    from the requests' canvases laid end to end (tests/test_decide_rows.py: the per-request
    loop it replaced)."""
    offsets, acc = [], 0
    for req in reqs:
        offsets.append(acc)
        acc += req.canvas_len
    ints = torch.tensor([(it.view_start, it.view_end - it.view_start, *req.block,
                          req.prompt_len, off)
                         for req, it, off in zip(reqs, items, offsets)], dtype=torch.long)
    view_start, n, start, end, prompt_len, off = ints.t()[:, :, None]   # each [n, 1]
    cols = torch.arange(width)
    pos = view_start + cols                                             # [n, W]
    valid = cols < n
    canvas = torch.cat([req.canvas for req in reqs])                    # [sum L]
    tokens = canvas[(off + pos).clamp(max=acc - 1)].masked_fill_(~valid, reqs[0].mask_id)
    seeds = torch.zeros_like(valid)
    picks = [(i, s - it.view_start) for i, it in enumerate(items) for s, _ in it.override]
    if picks:
        seeds[tuple(torch.tensor(picks, dtype=torch.long).t())] = True
    return CanvasRows(tokens, valid, (pos >= start) & (pos < end) & valid,
                      (pos >= prompt_len) & valid, seeds, reqs[0].mask_id)


def _batch(reqs: list[Request], items, logits: list[torch.Tensor], drift=None,
           attn_in=None, extra_logits=None) -> StepBatch:
    width = max(x.shape[0] for x in logits)
    device = logits[0].device
    host = _canvas_rows(reqs, items, width)
    params = [r.params for r in reqs]
    extra = _extras(extra_logits, device)
    padded = stack_logits(logits, width)
    with torch.inference_mode():                   # the runner's logits are inference tensors
        mask_logits = padded.select(-1, reqs[0].mask_id).clone()   # [n, W], for confidences
        padded.select(-1, reqs[0].mask_id).fill_(float("-inf"))   # [MASK] is never a proposal
                                                # (else: stuck); two ops, where `[..., id] =` is 6
    # one copy (host_transfer.py); the candidates ride in it: a fifth [n, W] mask costs the
    # device no op, three on the device (== mask_id, & valid, & in_block) would (#42)
    tokens, valid, in_block, is_gen, seeds, candidates = to_device(
        [host.tokens, host.valid, host.in_block, host.is_gen, host.seeds, host.candidates],
        device)
    return StepBatch(
        logits=padded, tokens=tokens, valid=valid, in_block=in_block, is_gen=is_gen,
        states=[r.state for r in reqs],
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float64),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
        generators=[r.generator for r in reqs], mask_id=reqs[0].mask_id, seeds=seeds,
        drift=_stat(drift, width), attn_in=_stat(attn_in, width),
        extra_logits=extra[0], extra_valid=extra[1], host_rows=host, mask_logits=mask_logits,
        moved_candidates=candidates)


@dataclass
class _Group:
    """One strategy instance's share of the step, from `decide` to the host."""

    strategy: Strategy
    reqs: list[Request]
    items: list
    batch: StepBatch
    decision: Decision                     # device tensors, then (after the copy) host ones
    logprobs: dict[int, tuple]             # row -> logprob_rows' device (then host) tensors
    raw: dict[int, torch.Tensor]           # row -> its logits before the logits processors

    def raw_logits(self, row: int) -> torch.Tensor:
        """Request `row`'s logits as the model gave them ([MASK] excluded): what logprobs read."""
        return self.raw.get(row, self.batch.logits[row])

    def tensors(self) -> list[torch.Tensor | None]:
        return self.decision.tensors() + [t for rows in self.logprobs.values() for t in rows]

    def receive(self, host: list[torch.Tensor | None]) -> None:
        """Take the host copies of `tensors()`, in order."""
        fixed = len(self.decision.tensors())
        self.decision = self.decision.from_tensors(host[:fixed])
        rest = iter(host[fixed:])
        self.logprobs = {row: tuple(next(rest) for _ in parts)
                         for row, parts in self.logprobs.items()}


def run_strategies(out: SchedulerOutput, requests: dict[str, Request], result,
                   observers=(), transfer: HostTransfer | None = None
                   ) -> dict[str, RowDecision]:
    """One `decide` per strategy instance over the ModelRunnerOutput `result` (each observer's
    `on_decide(strategy, batch)` is called just before it), one copy of every decision to the
    host, then each request's row."""
    transfer = transfer or HostTransfer()
    groups = [_decide(out, requests, result, idx, observers)
              for idx in _group_rows(out, requests)]
    host = iter(transfer.fetch([t for g in groups for t in g.tensors()]))
    decisions, late = {}, []
    for g in groups:
        g.receive([next(host) for _ in g.tensors()])
        if g.batch.device.type == "meta":
            g.decision = _dry_run(g.batch, g.decision)
        g.strategy.absorb(g.batch, g.decision)
        rows = _rows(g.decision, [item.view_end - item.view_start for item in g.items])
        for row, (req, item, decision) in enumerate(zip(g.reqs, g.items, rows)):
            if req.grammar is not None:
                decision = constrain_decision(req.grammar, _view_row(g.batch, row, req, item),
                                              decision)
                if req.params.logprobs is not None:   # read after the edit: below
                    late.append((g, row, decision))
            elif req.params.logprobs is not None:
                attach_logprobs(decision, g.logprobs[row])
            decisions[req.request_id] = decision
    if late:
        _late_logprobs(late, transfer)
    return decisions


def _group_rows(out: SchedulerOutput, requests: dict[str, Request]) -> list[list[int]]:
    """The step's item indices grouped by strategy instance."""
    groups: dict[int, list[int]] = {}
    for i, item in enumerate(out.items):
        groups.setdefault(id(requests[item.request_id].strategy), []).append(i)
    return list(groups.values())


def _decide(out: SchedulerOutput, requests: dict[str, Request], result, idx: list[int],
            observers) -> _Group:
    """One strategy's decision for the items `idx`, on the logits' device, with the logprob
    rows of the requests that asked (structured requests read theirs after the constraint)."""
    items = [out.items[i] for i in idx]
    reqs = [requests[it.request_id] for it in items]
    stats = [None if result.drift is None else [getattr(result, f)[i] for i in idx]
             for f in ("drift", "attn_in")]
    extra = None if result.extra_logits is None else [result.extra_logits[i] for i in idx]
    strategy = reqs[0].strategy
    batch = _batch(reqs, items, [result.logits[i] for i in idx], *stats, extra_logits=extra)
    raw = process_logits(batch.logits, reqs, [it.view_start for it in items])
    for observer in observers:
        observer.on_decide(strategy, batch)
    saved = mask_frontiers([(r.grammar, batch.logits[row], _frontier_index(r, it))
                            for row, (r, it) in enumerate(zip(reqs, items)) if r.grammar])
    d = strategy.decide(batch)
    restore(saved)
    asked = [row for row, r in enumerate(reqs)
             if r.params.logprobs is not None and r.grammar is None]
    written = None if not asked else d.commit if d.replace is None else d.commit | d.replace
    logprobs = {row: logprob_rows(raw.get(row, batch.logits[row]), written[row],
                                  d.tokens[row], reqs[row].params.logprobs) for row in asked}
    return _Group(strategy, reqs, items, batch, d, logprobs, raw)


def _rows(d: Decision, widths: list[int]) -> list[RowDecision]:
    """Each request's decision over its view positions (`widths[row]` of them; host tensors):
    one `unbind` per decision tensor, and a slice only for a row narrower than the widest."""
    width = d.commit.shape[1]

    def split(t: torch.Tensor | None) -> list:
        if t is None:
            return [None] * len(widths)
        return [r if n == width else r[:n] for r, n in zip(t.unbind(0), widths)]

    def ints(t: torch.Tensor | None, default) -> list:
        return [default] * len(widths) if t is None else t.tolist()

    remasks = split(d.remask)               # None for a row that remasks nothing
    if d.remask is not None:
        remasks = [r if any_ else None for r, any_ in zip(remasks, d.remask.any(1).tolist())]
    return [RowDecision(commit=c, tokens=t, remask=rm, replace=rp, keeps=int(k),
                        verified=int(v), stop=bool(st))
            for c, t, rm, rp, k, v, st in zip(split(d.commit), split(d.tokens), remasks,
                                              split(d.replace), ints(d.keeps, 0),
                                              ints(d.verified, 0), ints(d.stop, False))]


def _dry_run(batch: StepBatch, d: Decision) -> Decision:
    """A shapes-only ("meta") step has no values, so its host copy is zeros, which would commit
    nothing forever: it commits every [MASK] of the current block instead (a token that is not
    [MASK]), so a dry run ends as a real one would (tests/test_device.py, the meta benchmarks)."""
    candidates = batch.host.candidates
    token = 1 if batch.mask_id == 0 else 0
    return Decision(commit=candidates, tokens=torch.full_like(d.tokens, token),
                    remask=None if d.remask is None else torch.zeros_like(candidates),
                    replace=None if d.replace is None else torch.zeros_like(candidates),
                    keeps=d.keeps, verified=d.verified, stop=d.stop, state=d.state)


def _late_logprobs(late: list, transfer: HostTransfer) -> None:
    """Logprobs of structured requests, for the decisions the constraint settled: one more
    device pass and copy."""
    parts = []
    for g, row, decision in late:
        written = decision.commit if decision.replace is None else \
            decision.commit | decision.replace
        logits = g.raw_logits(row)[: written.shape[0]]
        parts.append(logprob_rows(logits, written.to(logits.device),
                                  decision.tokens.to(logits.device),
                                  g.reqs[row].params.logprobs))
    host = iter(transfer.fetch([t for p in parts for t in p]))
    for (_, _, decision), p in zip(late, parts):
        attach_logprobs(decision, tuple(next(host) for _ in p))


def _frontier_index(req: Request, item) -> int:
    """The view index of the grammar's frontier when the next token there is still open."""
    f = req.grammar.frontier
    if item.view_start <= f < min(item.view_end, req.gen_end) and int(req.canvas[f]) == \
            req.mask_id:
        return f - item.view_start
    return -1


def _view_row(batch: StepBatch, row: int, req: Request, item) -> ViewRow:
    n = item.view_end - item.view_start
    host = batch.host
    if req.strategy.masked_rows_only:    # a sparse window computes masked rows and seeds only
        drawable = host.masked[row, :n] | host.seeds[row, :n]
    else:
        drawable = host.valid[row, :n]
    return ViewRow(item.view_start, host.tokens[row, :n], batch.logits[row, :n], drawable,
                   req.gen_end, req.mask_id, req.params.temperature, req.generator)

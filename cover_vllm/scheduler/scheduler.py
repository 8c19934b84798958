"""Scheduler: admission by KV pages and packing: one work item per running request per step.

The scheduler never calls a strategy: the engine's strategy stage (engine/strategy_stage.py)
hands it each request's StepPlan (view, seeds, extra rows, embedding edits, cfg), and the
request applies its own decision after the forward (Request.finish_step).
There is no global draft or verify phase: every running request has a next item. A refresh item
(a full-canvas forward) starts each block when a cache mode is on, every step with
kv_cache="none", and whenever the request's `cache_refresh` policy asks (cache_refresh.py); other
steps forward only the window the cache mode needs (Fast-dLLM):
`prefix` = current block + suffix, `dual` = current block. Admission reserves pages for the whole
canvas, so a running request never needs more and is never preempted. An admitted request's
canvas moves into its row of the persistent batch (scheduler/canvas_table.py) until it ends, and
a step's window inputs are read from there for every item at once.
"""

from __future__ import annotations

from collections import deque

import torch

from cover_vllm.config import EngineConfig
from cover_vllm.scheduler.canvas_queue import CanvasQueue
from cover_vllm.scheduler.canvas_request import CanvasRequest
from cover_vllm.scheduler.canvas_table import CanvasTable
from cover_vllm.scheduler.output import CanvasInput, SchedulerOutput, WorkItem
from cover_vllm.scheduler.page_pool import PagePool
from cover_vllm.scheduler.prefix_cache import page_keys
from cover_vllm.scheduler.request import (PageSet, Request, RequestStatus, abort_from,
                                          block_masked_counts)
from cover_vllm.scheduler.score_queue import ScoreQueue
from cover_vllm.step_plan import StepPlan


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagePool, logit_shift: int,
                 prefix_caching: bool = False, num_rings: int = 0):
        self.config, self.pool, self.logit_shift = config, pool, logit_shift
        self.prefix_caching = prefix_caching
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.table = CanvasTable(config.max_num_seqs)   # the running requests' canvases
        # likelihood scoring: admitted after the generation requests, packed beside them
        self.scoring = ScoreQueue(config, pool, prefix_caching)
        # uniform-state canvases (DiffusionGemma's requests; scheduler/canvas_queue.py)
        self.canvases = CanvasQueue(config, pool, num_rings)

    # ---- admission -------------------------------------------------------------------------
    def pages_needed(self, req: Request) -> int:
        return req.num_canvases * -(-req.canvas_len // self.config.page_size)

    def add_request(self, req: Request | CanvasRequest) -> None:
        if isinstance(req, CanvasRequest):
            self.canvases.add(req)
            return
        self.pool.check_fits(f"request {req.request_id!r}", self.pages_needed(req),
                             f"a {req.canvas_len}-token canvas", "lower max_tokens")
        self.waiting.append(req)

    def _admit(self) -> None:
        admitted, copies = [], []                         # copies: (pages, canvas length)
        while self.waiting and len(self.running) + len(admitted) < self.config.max_num_seqs:
            req = self.waiting[0]
            pages = self._take_pages(req)
            if pages is None:
                break                                     # FCFS: wait for pages to free up
            self.waiting.popleft()
            admitted.append(req)
            per = len(pages) // req.num_canvases
            copies += [(pages[c * per:(c + 1) * per], req.canvas_len)
                       for c in range(req.num_canvases)]
        tables = iter(zip(copies, page_slots(copies, self.config.page_size)))
        self.table.attach(admitted)
        for req, masked in zip(admitted, block_masked_counts(admitted)):
            for _ in range(req.num_canvases):
                (pages, _), slots = next(tables)
                req.pages.append(PageSet(pages, slots))
            req.status = RequestStatus.RUNNING
            req.begin_block(masked)
            self.running.append(req)

    def _take_pages(self, req: Request) -> list[int] | None:
        """Pages for the whole canvas: first the cached pages of its prompt prefix (prefix
        caching: their K/V are final, so the request starts past them), then fresh ones."""
        keys = self._prefix_keys(req)
        hits = self.pool.lookup(keys) if keys else []
        fresh = self.pool.allocate(self.pages_needed(req) - len(hits))
        if fresh is None:
            self.pool.free(hits)
            return None
        req.prefix_keys, req.prefix_indexed = keys, len(hits)
        req.cached_end = len(hits) * self.config.page_size
        req.metrics.cached_prompt_tokens = req.cached_end
        req.metrics.prefix_query_tokens = len(keys) * self.config.page_size
        return hits + fresh

    def _prefix_keys(self, req: Request) -> list[bytes]:
        """Content keys of the request's shareable prompt pages (none unless prefix caching is
        on and the request reuses K/V on a block-causal model with one canvas)."""
        if not self.prefix_caching or req.causal_block is None or req.kv_cache == "none" \
                or req.num_canvases != 1:
            return []
        return page_keys(req.canvas, req.prompt_len, req.causal_block, self.config.page_size)

    def index_prefix(self, req: Request) -> None:
        """After a step: index the request's prompt pages whose K/V became final."""
        done = min(req.cached_end // self.config.page_size, len(req.prefix_keys))
        for i in range(req.prefix_indexed, done):
            self.pool.index(req.pages[0].pages[i], req.prefix_keys[i])
        req.prefix_indexed = max(req.prefix_indexed, done)

    def abort_request(self, request_id: str) -> Request | CanvasRequest | None:
        canvas = self.canvases.abort(request_id)
        if canvas is not None:
            return canvas
        return abort_from(request_id, self.waiting, self.running, self.finish)

    def finish(self, req: Request | CanvasRequest, reason: str) -> None:
        if isinstance(req, CanvasRequest):
            self.canvases.finish(req, reason)
            return
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        for pageset in req.pages:
            self.pool.free(pageset.pages)
        req.pages = []
        self.table.detach(req)

    # ---- one step --------------------------------------------------------------------------
    def admit(self) -> list[Request]:
        """Admit waiting requests while pages allow (FCFS); the running requests, each due one
        work item this step."""
        self._admit()
        self.canvases.admit(len(self.running))
        self.scoring.admit(len(self.running) + len(self.canvases.running))
        return list(self.running)

    def pack(self, requests: list[Request], plans: list[StepPlan]) -> SchedulerOutput:
        """One work item per request (from `admit`) and its strategy's plan, and the running
        scoring and canvas requests' items."""
        waiting = len(self.waiting) + len(self.scoring.waiting) + len(self.canvases.waiting)
        pending: list[tuple] = []          # windows read from the canvas table below
        items = [self._work_item(r, p, pending) for r, p in zip(requests, plans)]
        if pending:
            self._gather_windows(pending)
        return SchedulerOutput(items, waiting, score_items=self.scoring.schedule(),
                               canvas_items=self.canvases.schedule())

    def _cond_input(self, req: Request, window: tuple[int, int], rel: list[int],
                    pending: list) -> torch.Tensor | None:
        """The cond canvas's window tokens with the seeds (window rows `rel`) masked; None when
        they are read for the whole batch at once from the canvas table (`pending`)."""
        if req.slot is not None:
            pending.append((req.slot, *window, rel, req.mask_id))
            return None
        ids = req.canvas[window[0]:window[1]].clone()
        if rel:
            ids[rel] = req.mask_id
        return ids

    def _gather_windows(self, pending: list) -> None:
        """Fill the pending items' cond input ids: one gather from the canvas table, one write
        of every seed's [MASK], one split (the items' ids are views of one tensor)."""
        ints = torch.tensor([(slot, start, end - start) for _, slot, start, end, _, _ in pending],
                            dtype=torch.long)
        slot, start, length = ints.t()
        total = sum(end - start for _, _, start, end, _, _ in pending)
        first = torch.cumsum(length, 0) - length
        cols = torch.repeat_interleave(start - first, length, output_size=total) + \
            torch.arange(total)
        ids = self.table.tokens[torch.repeat_interleave(slot, length, output_size=total), cols]
        seeds, offset = [], 0
        for _, _, start, end, rel, _ in pending:
            seeds += [offset + r for r in rel]
            offset += end - start
        if seeds:
            ids[seeds] = pending[0][5]
        for (item, _, start, end, _, _), piece in zip(
                pending, ids.split([end - start for _, _, start, end, _, _ in pending])):
            item.canvases[0].input_ids = piece

    def _window(self, req: Request, refresh: bool, view_start: int) -> tuple[int, int]:
        if refresh:
            return 0, req.canvas_len
        start, end = req.block
        first_row = max(min(start, view_start) - self.logit_shift, 0)
        if req.kv_cache == "prefix":
            return first_row, req.canvas_len
        return first_row, end

    def _sparse_window(self, req: Request, seeds: list[int], outside: bool) -> torch.Tensor:
        """[W] sorted positions whose cached K/V no longer match the canvas or whose logits are
        needed: the block's [MASK] positions, block positions whose token changed since their
        K/V were last computed, the seeds, and every predictor row of those; with `outside`,
        also every position outside the block (a partial refresh)."""
        start, end = req.block
        block = req.canvas[start:end]
        need = (block == req.mask_id) | (block != req.kv_tokens[start:end])
        pos = start + need.nonzero().flatten()
        if outside:
            pos = torch.cat((self._outside_positions(req), pos))
        if seeds:
            pos = torch.cat((pos, torch.tensor(seeds, dtype=torch.long)))
        rows = (pos - self.logit_shift).clamp(min=0)
        pos = torch.unique(torch.cat((pos, rows)))            # sorted
        return pos if pos.numel() else torch.tensor([start])

    @staticmethod
    def _outside_positions(req: Request) -> torch.Tensor:
        """The cached positions a partial refresh recomputes: all outside the block, or those
        that took `refresh_mass_share` of the attention on them (most-attended first)."""
        start, end = req.block
        out = torch.cat((torch.arange(start), torch.arange(end, req.canvas_len)))
        share, mass = req.refresh.policy.refresh_mass_share, req.refresh.column_mass
        if share is None or mass is None or float(mass[out].sum()) <= 0:
            return out
        m = mass[out]
        order = torch.argsort(m, descending=True)
        cum = torch.cumsum(m[order], 0) / m.sum()
        keep = int((cum < share).sum()) + 1
        return out[order[:keep]]

    def _block_causal_item(self, req: Request, plan: StepPlan, pending: list) -> WorkItem:
        """A block-causal request's step: the current block against the exact K/V of every
        earlier block, from the first position whose K/V are not final yet (so the prompt's
        full blocks are prefilled, and a finished block's K/V rewritten from its final tokens,
        in the same forward as the next block's first step). Keys end at the block's end: no
        row of the window sees a later block. `kv_cache="none"` recomputes from position 0
        every step (the official LLaDA2 `generate`)."""
        start, end = req.block
        w_start = 0 if req.kv_cache == "none" else req.block_window_start
        view_start = max(plan.view_start, start)         # decoders run inside the block
        seeds = [s for s in plan.seeds if start <= s < end]
        canvases = [CanvasInput(c[w_start:end].clone(), ps.key_slots[:end]) for c, ps in
                    zip([req.uncond_canvas()] if req.num_canvases == 2 else [], req.pages[1:])]
        ids = self._cond_input(req, (w_start, end), [s - w_start for s in seeds], pending)
        canvases.insert(0, CanvasInput(ids, req.pages[0].key_slots[:end]))
        item = WorkItem(req.request_id, w_start, canvases, view_start, end,
                        override=[(s, max(s - self.logit_shift, 0)) for s in seeds],
                        cfg_scale=plan.cfg_scale, want_stats=plan.want_stats,
                        extra=plan.extra, embed_edit=plan.embed_edit,
                        causal_block=req.causal_block, masked_rows_only=plan.masked_rows_only,
                        causal_commit=req.causal_commit)
        if ids is None:
            pending[-1] = (item, *pending[-1])
        return item

    def _work_item(self, req: Request, plan: StepPlan, pending: list) -> WorkItem:
        if req.causal_block is not None:
            return self._block_causal_item(req, plan, pending)
        start, end = req.block
        refresh = req.kv_cache == "none" or req.refresh.should_refresh(
            end - start, req.canvas_len - (end - start))
        view_start, seeds = plan.view_start, plan.seeds
        positions = None
        policy = req.refresh.policy
        sparse = (req.kv_cache == "dual" and policy.sparse and plan.masked_rows_only
                  and req.num_canvases == 1)
        if sparse and refresh and not req.refresh.pending and not policy.refresh_block:
            positions = self._sparse_window(req, seeds, outside=True)
        elif sparse and not refresh:
            positions = self._sparse_window(req, seeds, outside=False)
        if positions is not None:
            if not refresh:
                req.refresh.save(end - start - int(positions.numel()))
            w_start = int(positions[0])
            canvases = [CanvasInput(req.canvas[positions], req.pages[0].key_slots)]
            rel = torch.searchsorted(positions, torch.tensor(seeds, dtype=torch.long))
            if seeds:                       # verified in the same forward: masked in the input
                canvases[0].input_ids[rel] = req.mask_id
            ids = canvases[0].input_ids
        else:
            w_start, w_end = self._window(req, refresh, view_start)
            canvases = [CanvasInput(req.uncond_canvas()[w_start:w_end].clone(), ps.key_slots)
                        for ps in req.pages[1:]]          # cfg's uncond copy
            ids = self._cond_input(req, (w_start, w_end), [s - w_start for s in seeds], pending)
            canvases.insert(0, CanvasInput(ids, req.pages[0].key_slots))
        override = [(s, max(s - self.logit_shift, 0)) for s in seeds]
        item = WorkItem(req.request_id, w_start, canvases, view_start, end, override=override,
                        cfg_scale=plan.cfg_scale, is_refresh=refresh,
                        want_stats=plan.want_stats,
                        want_mass=req.kv_cache != "none" and req.refresh.policy.wants_mass,
                        extra=plan.extra, embed_edit=plan.embed_edit,
                        window_positions=positions, masked_rows_only=plan.masked_rows_only)
        if ids is None:
            pending[-1] = (item, *pending[-1])
        return item


def page_slots(copies: list[tuple[list[int], int]], page: int) -> list[torch.Tensor]:
    """The cache slot of every canvas position ([L] each) of canvas copies given as (their
    pages, canvas length L): position p lives at pages[p // page] * page + p % page. One set
    of tensor ops for every copy admitted in a step."""
    if not copies:
        return []
    lengths = [length for _, length in copies]
    first_page, acc = [], 0
    for pages, _ in copies:
        first_page.append(acc)
        acc += len(pages)
    starts, acc = [], 0
    for length in lengths:
        starts.append(acc)
        acc += length
    ints = torch.tensor(list(zip(starts, first_page, lengths)), dtype=torch.long)
    start, first, length = ints.t()
    pos = torch.arange(acc) - torch.repeat_interleave(start, length, output_size=acc)
    index = pos // page + torch.repeat_interleave(first, length, output_size=acc)
    table = torch.tensor([p for pages, _ in copies for p in pages], dtype=torch.long)
    return list((table[index] * page + pos % page).split(lengths))

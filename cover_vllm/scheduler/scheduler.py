"""Scheduler: admission by KV pages, one work item per running request per step, and updates.

There is no global draft or verify phase: every running request has a next item. A refresh item
(a full-canvas forward) starts each block when a cache mode is on, every step with
kv_cache="none", and whenever the request's `cache_refresh` policy asks (cache_refresh.py); other
steps forward only the window the cache mode needs (Fast-dLLM):
`prefix` = current block + suffix, `dual` = current block. Admission reserves pages for the whole
canvas, so a running request never needs more and is never preempted.
"""

from __future__ import annotations

from collections import deque

import torch

from cover_vllm.config import EngineConfig
from cover_vllm.scheduler.output import CanvasInput, SchedulerOutput, WorkItem
from cover_vllm.scheduler.page_pool import PagePool
from cover_vllm.scheduler.request import PageSet, Request, RequestStatus


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagePool, logit_shift: int):
        self.config, self.pool, self.logit_shift = config, pool, logit_shift
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- admission -------------------------------------------------------------------------
    def pages_needed(self, req: Request) -> int:
        return req.num_canvases * -(-req.canvas_len // self.config.page_size)

    def add_request(self, req: Request) -> None:
        need = self.pages_needed(req)
        if need > self.pool.num_pages:
            raise ValueError(
                f"request {req.request_id!r} needs {need} KV pages for a {req.canvas_len}-token "
                f"canvas but the pool has {self.pool.num_pages}; raise kv_cache_memory_bytes or "
                "lower max_tokens")
        self.waiting.append(req)

    def _admit(self) -> None:
        page = self.config.page_size
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            pages = self.pool.allocate(self.pages_needed(req))
            if pages is None:
                return                                    # FCFS: wait for pages to free up
            self.waiting.popleft()
            per = len(pages) // req.num_canvases
            pos = torch.arange(req.canvas_len)
            for c in range(req.num_canvases):
                table = torch.tensor(pages[c * per:(c + 1) * per], dtype=torch.long)
                req.pages.append(PageSet(pages[c * per:(c + 1) * per],
                                         table[pos // page] * page + pos % page))
            req.status = RequestStatus.RUNNING
            req.begin_block()
            self.running.append(req)

    def abort_request(self, request_id: str) -> Request | None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.finish(req, "abort")
                return req
        return None

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        for pageset in req.pages:
            self.pool.free(pageset.pages)
        req.pages = []

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._admit()
        return SchedulerOutput([self._work_item(r) for r in self.running], len(self.waiting))

    def _window(self, req: Request, refresh: bool, view_start: int) -> tuple[int, int]:
        if refresh:
            return 0, req.canvas_len
        start, end = req.block
        first_row = max(min(start, view_start) - self.logit_shift, 0)
        if req.kv_cache == "prefix":
            return first_row, req.canvas_len
        return first_row, end

    def _work_item(self, req: Request) -> WorkItem:
        start, end = req.block
        refresh = req.kv_cache == "none" or req.refresh.should_refresh(end - start)
        view_start = req.strategy.view_start(start, req.prompt_len)
        w_start, w_end = self._window(req, refresh, view_start)
        copies = [req.canvas] + ([req.uncond_canvas()] if req.num_canvases == 2 else [])
        canvases = [CanvasInput(c[w_start:w_end].clone(), ps.key_slots)
                    for c, ps in zip(copies, req.pages)]
        seeds = req.strategy.select_seeds(req.state, req.canvas[start:end], start)
        req.seeds = seeds
        if seeds:                           # verified in the same forward: masked in the input
            canvases[0].input_ids[[s - w_start for s in seeds]] = req.mask_id
        override = [(s, max(s - self.logit_shift, 0)) for s in seeds]
        return WorkItem(req.request_id, w_start, canvases, view_start, end, override=override,
                        cfg_scale=req.strategy.cfg_scale, is_refresh=refresh,
                        want_stats=req.strategy.wants_stats,
                        extra=req.strategy.extra_rows(req.state, req.canvas, req.block),
                        embed_edit=req.strategy.embed_edits(req.state, req.canvas, req.block))

    def get(self, request_id: str) -> Request:
        for req in self.running:
            if req.request_id == request_id:
                return req
        raise KeyError(request_id)

    # ---- after the forward -----------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, decisions: dict) -> list[Request]:
        """Apply each request's decision; return the requests whose current block is complete."""
        by_id = {r.request_id: r for r in self.running}
        done = []
        for item in out.items:
            req, d = by_id[item.request_id], decisions[item.request_id]
            changed, revised = req.apply(item.view_start, d.commit, d.tokens, d.remask,
                                         d.replace)
            req.refresh.record(item.is_refresh, changed, revised)
            m = req.metrics
            m.nfe += 1
            m.keeps += d.keeps
            m.seeds_verified += d.verified
            m.refreshes += int(item.is_refresh)
            if req.strategy.block_done(req.state, req.block_masked()):
                done.append(req)
        return done

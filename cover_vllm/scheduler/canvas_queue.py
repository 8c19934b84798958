"""CanvasQueue: the scheduler's part for uniform-state requests (DiffusionGemma): admission by
pages and sliding-window rings, each step's CanvasItems, and freeing both when a request ends.

A request holds, from admission to its end, pages for every position whose K/V are ever written
(its prompt and every canvas but the last: the full-attention layers keep them all) and one ring
of the sliding-window layers (worker/kv_cache.py `KVLayout`). Nothing grows later, so a running
request is never preempted. Admission is FCFS within `max_num_seqs` sequences (shared with any
other running requests); every running request has an item every step (continuous batching:
requests join and leave between steps, each at its own canvas and step).
"""

from __future__ import annotations

from collections import deque

import torch

from cover_vllm.config import EngineConfig
from cover_vllm.scheduler.canvas_request import CanvasRequest
from cover_vllm.scheduler.output import CanvasItem
from cover_vllm.scheduler.page_pool import PagePool
from cover_vllm.scheduler.request import RequestStatus, abort_from


class CanvasQueue:
    def __init__(self, config: EngineConfig, pool: PagePool, num_rings: int):
        self.pool, self.page = pool, config.page_size
        self.max_seqs = config.max_num_seqs
        self.free_rings = list(range(num_rings))
        self.waiting: deque[CanvasRequest] = deque()
        self.running: list[CanvasRequest] = []
        self._admitted: list[CanvasRequest] = []

    def pages_needed(self, req: CanvasRequest) -> int:
        return -(-req.kv_positions // self.page)

    def add(self, req: CanvasRequest) -> None:
        self.pool.check_fits(f"request {req.request_id!r}", self.pages_needed(req),
                             f"{req.kv_positions} encoded positions", "lower max_tokens")
        self.waiting.append(req)

    def has(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in (*self.waiting, *self.running))

    # ---- admission -------------------------------------------------------------------------
    def admit(self, others: int) -> None:
        """Admit waiting requests (FCFS) while sequences (beside `others` running ones), rings
        and pages allow."""
        while self.waiting and others + len(self.running) < self.max_seqs and self.free_rings:
            req = self.waiting[0]
            pages = self.pool.allocate(self.pages_needed(req))
            if pages is None:
                return
            self.waiting.popleft()
            pos = torch.arange(req.kv_positions)
            table = torch.tensor(pages, dtype=torch.long)
            req.pages, req.ring = pages, self.free_rings.pop()
            req.key_slots = table[pos // self.page] * self.page + pos % self.page
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._admitted.append(req)

    def take_admitted(self) -> list[CanvasRequest]:
        """The requests admitted since the last call (their first canvas is still to draw)."""
        admitted, self._admitted = self._admitted, []
        return admitted

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> list[CanvasItem]:
        return [req.next_item() for req in self.running]

    def finish(self, req: CanvasRequest, reason: str) -> None:
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if req in self.running:
            self.running.remove(req)
            self.pool.free(req.pages)
            self.free_rings.append(req.ring)
            req.pages, req.ring = [], None
        if req in self._admitted:
            self._admitted.remove(req)

    def abort(self, request_id: str) -> CanvasRequest | None:
        return abort_from(request_id, self.waiting, self.running, self.finish)

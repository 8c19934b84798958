"""ScoreQueue: the scheduler's part for scoring requests: admission by KV pages and sequence
budget, each step's ScoreItems, the shared context prefixes, and freeing pages as work ends.

Generation requests are admitted first (scheduler/scheduler.py); scoring requests take what is
left of `max_num_seqs` sequences per forward (each masked copy or greedy canvas is one sequence,
two with cfg), FCFS, and at least one request runs when nothing else does. A request holds pages
for `num_slots` copies (reused by its later copies) and, while its greedy check runs, for one
greedy canvas; the copies' pages are freed as soon as its last copy has run, the rest when it ends.

Block-causal models: a context's full blocks [0, C0) are computed once per (tokens, variant) and
read by every copy: by the request's own copies always, and by other requests with the same
context prefix when prefix caching is on (the automatic prefix cache's page keys, so generation
prompts and scoring contexts share pages too). A prefix not yet written is written by the first
request that runs it, in the same forward as its readers: every layer writes all fresh K/V before
any sequence gathers its keys (attention/base.py), and a clean block's K/V depend only on blocks
at or before it.
"""

from __future__ import annotations

from collections import deque

import torch

from cover_vllm.config import EngineConfig
from cover_vllm.scheduler.page_pool import PagePool
from cover_vllm.scheduler.prefix_cache import page_keys
from cover_vllm.scoring.items import ScoreItem, ScoreResult
from cover_vllm.scoring.params import LoglikelihoodOutput
from cover_vllm.scheduler.score_request import ScoringRequest, SharedPrefix


class ScoreQueue:
    def __init__(self, config: EngineConfig, pool: PagePool, prefix_caching: bool):
        self.pool, self.page = pool, config.page_size
        self.max_seqs = config.max_num_seqs
        self.prefix_caching = prefix_caching
        self.waiting: deque[ScoringRequest] = deque()
        self.running: list[ScoringRequest] = []
        self._prefixes: dict[tuple, SharedPrefix] = {}
        self._in_flight: dict[str, list[int]] = {}     # request id -> copies of this step

    # ---- requests --------------------------------------------------------------------------
    def _pages(self, positions: int) -> int:
        return -(-positions // self.page)

    def min_pages(self, req: ScoringRequest) -> int:
        """Pages the request needs to run at all: its prefixes, one copy slot, a greedy canvas."""
        per_slot = req.num_canvases * self._pages(req.run_len)
        greedy = per_slot if req.params.check_greedy else 0
        return req.num_canvases * self._pages(req.shared_end) + per_slot + greedy

    def add(self, req: ScoringRequest) -> None:
        self.pool.check_fits(f"scoring request {req.request_id!r}", self.min_pages(req),
                             f"its {req.L}-token sequence", "shorten the context")
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                return True
        for req in self.running:
            if req.request_id == request_id:
                self._release(req)
                return True
        return False

    def has(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in (*self.waiting, *self.running))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_seqs(self) -> int:
        """Sequences the running scoring requests put in each forward (at most)."""
        return sum(self._seqs_of(r) for r in self.running)

    @staticmethod
    def _seqs_of(req: ScoringRequest) -> int:
        return req.num_canvases * (len(req.slots) + (req.greedy_slots is not None))

    # ---- admission -------------------------------------------------------------------------
    def admit(self, generating: int) -> None:
        """Admit waiting requests while sequences (beside `generating` requests) and pages
        allow, FCFS."""
        while self.waiting:
            req = self.waiting[0]
            room = self.max_seqs - generating - self.num_seqs()
            nothing_runs = generating == 0 and not self.running
            greedy = req.num_canvases if req.params.check_greedy else 0
            slots = min(req.draws.num_copies, (room - greedy) // req.num_canvases)
            if slots < 1 and not nothing_runs:
                return
            if not self._take_pages(req, max(slots, 1)):
                return
            self.waiting.popleft()
            self.running.append(req)

    def _take_pages(self, req: ScoringRequest, slots: int) -> bool:
        prefixes = [self._prefix(req, v) for v in range(req.num_canvases)] \
            if req.shared_end else []
        if any(p is None for p in prefixes):
            self._drop_prefixes([p for p in prefixes if p is not None])
            return False
        per_canvas = self._pages(req.run_len)
        greedy = req.num_canvases if req.params.check_greedy else 0
        free = self.pool.num_free // (per_canvas * req.num_canvases)
        slots = min(slots, free - (greedy > 0))
        pages = self.pool.allocate((slots * req.num_canvases + greedy) * per_canvas) \
            if slots >= 1 else None
        if pages is None:
            self._drop_prefixes(prefixes)
            return False
        req.prefixes = prefixes
        pos = torch.arange(req.run_len)

        def canvas_slots(k: int) -> torch.Tensor:
            table = torch.tensor(pages[k * per_canvas:(k + 1) * per_canvas], dtype=torch.long)
            return table[pos // self.page] * self.page + pos % self.page

        n = req.num_canvases
        req.slots = [[canvas_slots(s * n + v) for v in range(n)] for s in range(slots)]
        req.pages = pages[:slots * n * per_canvas]
        if greedy:
            req.greedy_slots = [canvas_slots(slots * n + v) for v in range(n)]
            req.greedy_pages = pages[slots * n * per_canvas:]
        req.metrics.shared_context_tokens = req.shared_end * len(prefixes)
        return True

    def _prefix(self, req: ScoringRequest, variant: int) -> SharedPrefix | None:
        """The shared K/V of the request's clean context blocks for one variant (one more
        reference), or None when the pages are not there."""
        end, block = req.shared_end, req.geo.causal_block
        tokens = req.variant_tokens(variant)[:end]
        owner = None if self.prefix_caching else req.request_id
        key = (owner, block, self.page, variant == 1, tuple(tokens.tolist()))
        prefix = self._prefixes.get(key)
        if prefix is not None:
            prefix.refs += 1
            return prefix
        keys = page_keys(tokens, end, block, self.page) if self.prefix_caching else []
        hits = self.pool.lookup(keys) if keys else []
        fresh = self.pool.allocate(self._pages(end) - len(hits))
        if fresh is None:
            self.pool.free(hits)
            return None
        pages = hits + fresh
        pos = torch.arange(end)
        slots = torch.tensor(pages, dtype=torch.long)[pos // self.page] * self.page \
            + pos % self.page
        written = min(len(hits) * self.page, end)
        req.metrics.cached_context_tokens += written
        prefix = SharedPrefix(key, pages, slots, written, end, keys)
        self._prefixes[key] = prefix
        return prefix

    def _drop_prefixes(self, prefixes: list[SharedPrefix]) -> None:
        for prefix in prefixes:
            prefix.refs -= 1
            if prefix.refs == 0:
                del self._prefixes[prefix.key]
                self.pool.free(prefix.pages)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> list[ScoreItem]:
        """Every running request's item for this step."""
        items = []
        for req in self.running:
            item, copies = req.next_item()
            self._in_flight[req.request_id] = copies
            items.append(item)
        return items

    def update(self, items: list[ScoreItem],
               results: list[ScoreResult]) -> list[LoglikelihoodOutput]:
        """Fold a forward's results into their requests; the finished ones' outputs."""
        by_id = {r.request_id: r for r in self.running}
        done = []
        for item, result in zip(items, results):
            req = by_id.get(item.request_id)
            copies = self._in_flight.pop(item.request_id, [])
            if req is None:                       # aborted while its forward ran
                continue
            for prefix in req.prefixes:
                if prefix.writer == req.request_id:
                    self._written(prefix)
            req.absorb(item, copies, result)
            if req.samples_done and req.pages:    # the copies' pages are free at once
                self.pool.free(req.pages)
                req.pages, req.slots = [], []
            if req.finished:
                self._release(req)
                done.append(req.output())
        return done

    def _written(self, prefix: SharedPrefix) -> None:
        prefix.written_end, prefix.writer = prefix.end, None
        for page, key in zip(prefix.pages, prefix.page_keys):
            self.pool.index(page, key)

    def _release(self, req: ScoringRequest) -> None:
        self.running.remove(req)
        self._in_flight.pop(req.request_id, None)
        self.pool.free(req.pages + req.greedy_pages)
        req.pages, req.greedy_pages, req.slots, req.greedy_slots = [], [], [], None
        for prefix in req.prefixes:
            if prefix.writer == req.request_id:   # aborted mid-write: the next reader writes it
                prefix.writer = None
        self._drop_prefixes(req.prefixes)
        req.prefixes = []

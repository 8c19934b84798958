"""PagePool: the KV pages shared by all requests (the same page id in every layer), with
reference counts and the content index of automatic prefix caching.

A page is free, held (reference count > 0) or *cached*: no request holds it but its K/V are
final and indexed by a content key (scheduler/prefix_cache.py), so a later request with the
same prompt prefix can take it without computing it. Cached pages count as free: `allocate`
takes never-indexed pages first, then evicts cached ones least recently used first (vLLM's
automatic prefix caching does the same).
"""

from __future__ import annotations

from collections import OrderedDict


class PagePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._cached: OrderedDict[int, bytes] = OrderedDict()   # unheld indexed pages, LRU first
        self._page_of: dict[bytes, int] = {}                    # content key -> page
        self._key_of: dict[int, bytes] = {}                     # page -> content key
        self.peak_used = 0
        self.prefix_queries = 0      # pages looked up by content key
        self.prefix_hits = 0         # of which found (their K/V never computed again)

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def check_fits(self, request: str, need: int, what: str, remedy: str) -> None:
        """Refuse a request that needs more pages than the whole pool: it could never run.
        `request` names it, `what` the positions the pages hold, `remedy` the fix."""
        if need > self.num_pages:
            raise ValueError(f"{request} needs {need} KV pages for {what} but the pool has "
                             f"{self.num_pages}; raise kv_cache_memory_bytes or {remedy}")

    def allocate(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        if n > self.num_free:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:                                      # evict the least recently used
                page, key = self._cached.popitem(last=False)
                del self._page_of[key], self._key_of[page]
            self._refs[page] = 1
            pages.append(page)
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; an indexed page nobody holds stays cached."""
        for page in reversed(pages):
            self._refs[page] -= 1
            assert self._refs[page] >= 0, f"page {page} freed more often than taken"
            if self._refs[page]:
                continue
            if page in self._key_of:
                self._cached[page] = self._key_of[page]
            else:
                self._free.append(page)

    def reset_prefix_cache(self) -> None:
        """Forget every content key (vLLM's `reset_prefix_cache`): cached pages become free,
        held pages stay held but are never found by a lookup again. Counters are kept."""
        self._free.extend(reversed(self._cached))
        self._cached.clear()
        self._page_of.clear()
        self._key_of.clear()

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest run of `keys` (in order) whose K/V are cached, each taken
        with one more reference; counts the queries and hits."""
        hits = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._cached[page]
            self._refs[page] += 1
            hits.append(page)
        self.prefix_queries += len(keys)
        self.prefix_hits += len(hits)
        self.peak_used = max(self.peak_used, self.num_used)
        return hits

    def index(self, page: int, key: bytes) -> None:
        """Record that held `page` now holds final K/V of content `key` (first one wins)."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key], self._key_of[page] = page, key

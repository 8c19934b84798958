"""PagePool: the free list of KV pages shared by all requests (the same page id in every layer)."""

from __future__ import annotations


class PagePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

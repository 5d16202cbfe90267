"""KV page allocator with a page-granular prefix cache (CPU only; never touches a device).

Page 0 is the padding page and is never handed out. Every other page is in exactly one state:

    free        refcount 0, no hash           -> handed out first
    cached      refcount 0, hash registered   -> reusable by a prefix hit, evicted LRU-first
    in use      refcount > 0                  -> owned by one or more requests

Who frees a page: the scheduler calls ``release`` for a request's pages only after the result
of the last step that referenced the request has come back (docs/design.md §4.3), so a page is never
reused while an in-flight step may still write or read it.

Prefix hashes chain over full pages: ``h_i = hash((h_{i-1}, tokens of page i))``. A page is
registered only once its KV is known to be written (after the step's result) and only if all its
positions lie inside the committed length.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class OutOfPages(Exception):
    pass


def page_hashes(tokens: np.ndarray, page_size: int, limit_pages: int) -> list[int]:
    """Chained hashes of the first ``limit_pages`` full pages of ``tokens``."""
    out: list[int] = []
    prev = 0
    for i in range(min(limit_pages, len(tokens) // page_size)):
        prev = hash((prev, tokens[i * page_size : (i + 1) * page_size].tobytes()))
        out.append(prev)
    return out


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_cache: bool = True):
        self.page_size = page_size
        self.total = num_pages - 1  # usable pages (1..num_pages-1)
        self.enable_cache = enable_cache
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() from the end
        self._ref = np.zeros(num_pages, dtype=np.int32)
        self._hash_of: dict[int, int] = {}  # page -> hash
        self._page_of: dict[int, int] = {}  # hash -> page
        self._cached: OrderedDict[int, None] = OrderedDict()  # refcount-0 hashed pages, LRU first

    # ------------------------------------------------------------ accounting
    @property
    def available(self) -> int:
        """Pages that an allocation could obtain now (free + evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def used(self) -> int:
        return self.total - self.available

    # ------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        if n > self.available:
            raise OutOfPages(f"need {n} pages, {self.available} available")
        out = []
        for _ in range(n):
            page = self._free.pop() if self._free else self._evict_one()
            self._ref[page] = 1
            out.append(page)
        return out

    def _evict_one(self) -> int:
        page, _ = self._cached.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        return page

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self._ref[page] -= 1
            assert self._ref[page] >= 0, f"page {page} freed twice"
            if self._ref[page] == 0:
                if page in self._hash_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    # ------------------------------------------------------------ prefix cache
    def match_prefix(self, hashes: list[int]) -> list[int]:
        """Take a reference on the longest run of cached pages matching ``hashes``."""
        if not self.enable_cache:
            return []
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self._ref[page] == 0:
                del self._cached[page]
            self._ref[page] += 1
        return pages

    def register(self, pages: list[int], hashes: list[int]) -> None:
        """Publish full, written pages under their chained hashes (first writer wins)."""
        if not self.enable_cache:
            return
        for page, h in zip(pages, hashes):
            if page in self._hash_of or h in self._page_of:
                continue
            self._hash_of[page] = h
            self._page_of[h] = page

    def flush(self) -> int:
        """Forget every cached prefix; in-use pages keep their data but lose their hash."""
        n = len(self._cached)
        for page in self._cached:
            self._free.append(page)
        self._cached.clear()
        self._hash_of.clear()
        self._page_of.clear()
        return n

    def check_all_free(self) -> None:
        """Test hook: every page is back (free or cached) and no reference is left."""
        assert int(self._ref[1:].sum()) == 0, "pages still referenced"
        assert self.available == self.total, f"{self.total - self.available} pages leaked"

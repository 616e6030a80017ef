"""The physical KV-cache pages behind `jserve.core.page_table.PageTable`: free list, refcounts, the
prefix cache's hash index and its LRU. Pure Python; knows nothing of requests.

`PagePool` owns `num_pages` pages of `page_size` token slots each. Page 0 is the null page: never
handed out, padded page-table entries point to it. Every other page is exactly one of *free*,
*used* (refcount > 0: owned by one or more requests) or *cached* (refcount 0, but its contents are
indexed by the prefix cache, so a later request can reuse them until the pool needs the page;
cached pages are evicted least recently used first).

Prefix-cache keys chain: a page's hash is sha256(parent page's hash, its token ids, cache salt),
so a page is reused only after the same whole prefix, and tenants with different salts never
share a page.
"""

import collections
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence

NULL_PAGE = 0


def hash_page(parent_hash: bytes | None, token_ids: Sequence[int], cache_salt: str | None) -> bytes:
    """Chained hash of one full page; sha256 because a collision would serve another prefix's K/V."""
    return hashlib.sha256(repr((parent_hash, tuple(token_ids), cache_salt)).encode()).digest()


def iter_page_hashes(token_ids: Sequence[int], page_size: int, cache_salt: str | None) -> Iterator[bytes]:
    """Yields the chained hash of each full page of `token_ids`, first page first."""
    parent = None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = hash_page(parent, token_ids[start:start + page_size], cache_salt)
        yield parent


def check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


class PagePool:
    """Free list, refcounts, prefix-hash index and the LRU of cached pages; knows nothing of requests."""

    def __init__(self, num_pages: int, page_size: int = 16):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the null page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcounts = [0] * num_pages
        self._free = collections.deque(range(1, num_pages))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._page_by_hash: dict[bytes, int] = {}
        self._hash_by_page: dict[int, bytes] = {}
        self.num_evicted_pages = 0
        self.on_cached: Callable[[int], None] | None = None  # told of each page that goes idle cached

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:
        """Idle pages (refcount 0) kept for the prefix cache."""
        return len(self._cached)

    @property
    def num_used_pages(self) -> int:
        """Pages owned by live requests."""
        return self.num_pages - 1 - len(self._free) - len(self._cached)

    @property
    def num_available_pages(self) -> int:
        """Pages `allocate` can hand out: free ones, then cached ones by eviction."""
        return len(self._free) + len(self._cached)

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def page_hash(self, page: int) -> bytes | None:
        return self._hash_by_page.get(page)

    def cached_page(self, page_hash: bytes) -> int | None:
        """The used or cached page holding this prefix hash, if any."""
        return self._page_by_hash.get(page_hash)

    def allocate(self, num: int) -> list[int] | None:
        """Takes `num` pages (refcount 1), evicting cached ones once none is free; None if short."""
        check_count("num", num)
        if num > self.num_available_pages:
            return None
        pages = [self._free.popleft() if self._free else self._evict_lru() for _ in range(num)]
        for page in pages:
            self._refcounts[page] = 1
        return pages

    def share(self, page: int) -> None:
        """One more owner for a used or cached page."""
        if self._refcounts[page] == 0:
            del self._cached[page]  # a KeyError here means a free page was shared: our bug
        self._refcounts[page] += 1

    def release(self, pages: Iterable[int]) -> None:
        """One owner fewer for each page, in order: the first to become cached is evicted first."""
        for page in pages:
            assert self._refcounts[page] > 0, f"page {page} released more often than shared"
            self._refcounts[page] -= 1
            if self._refcounts[page] == 0:
                if page in self._hash_by_page:
                    self._cached[page] = None
                    if self.on_cached is not None:
                        self.on_cached(page)
                else:
                    self._free.append(page)

    def register(self, page: int, page_hash: bytes) -> bool:
        """Indexes a full, computed, used page; False (not indexed) if another page holds this prefix."""
        assert self._refcounts[page] > 0 and page not in self._hash_by_page, page
        if page_hash in self._page_by_hash:
            return False
        self._page_by_hash[page_hash] = page
        self._hash_by_page[page] = page_hash
        return True

    def evict(self, num_pages: int | None = None) -> int:
        """Frees up to `num_pages` (all if None) cached pages, LRU first; returns how many."""
        if num_pages is not None:
            check_count("num_pages", num_pages)
        num = len(self._cached) if num_pages is None else min(num_pages, len(self._cached))
        for _ in range(num):
            self._free.append(self._evict_lru())
        return num

    def forget_prefixes(self) -> int:
        """Drop the prefix index (the pages' K/V came from other weights): cached pages are freed,
        used ones unindexed (freed, not cached, when released). Returns the pages freed."""
        num = self.evict()
        self._page_by_hash.clear()
        self._hash_by_page.clear()
        return num

    def _evict_lru(self) -> int:
        page, _ = self._cached.popitem(last=False)
        del self._page_by_hash[self._hash_by_page.pop(page)]
        self.num_evicted_pages += 1
        return page

    def check_invariants(self, owner_counts: collections.Counter) -> None:
        """Asserts that every page is exactly one of null, free, used (refcount = owners) or cached."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is twice on the free list"
        assert set(owner_counts) <= set(range(1, self.num_pages)), "an owner holds the null page or no page"
        assert self._refcounts[NULL_PAGE] == 0 and NULL_PAGE not in free, "the null page was handed out"
        assert NULL_PAGE not in self._cached and NULL_PAGE not in self._hash_by_page, "null page cached"
        for page in range(1, self.num_pages):
            refcount, num_owners = self._refcounts[page], owner_counts[page]
            assert refcount == num_owners, f"page {page}: refcount {refcount}, {num_owners} owners"
            states = (page in free, page in self._cached, refcount > 0)
            assert sum(states) == 1, f"page {page}: (free, cached, used) = {states}"
            assert page not in free or page not in self._hash_by_page, f"free page {page} has a hash"
            assert page not in self._cached or page in self._hash_by_page, f"cached page {page} has no hash"
        assert len(self._page_by_hash) == len(self._hash_by_page), "hash index not one-to-one"
        for page, page_hash in self._hash_by_page.items():
            assert self._page_by_hash.get(page_hash) == page, f"hash index disagrees on page {page}"

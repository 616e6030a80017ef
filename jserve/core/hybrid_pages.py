"""Hybrid pages for a model whose layers interleave full and sliding attention (Gemma 2 / 3):
two page tables per request over two pools, one for the full layers' K/V (every page kept) and
one for the sliding layers' (pages behind the window given back, as `PageTable(sliding_window=)`
does for Mistral). Pure Python, like `jserve.core.page_table`.

`HybridPageTable` is a `PageTable` to the scheduler: every call goes to both tables, and one that
may fail (a pool short) is planned on both first, so that neither changes unless both can. A
request's rows carry both lists (`ScheduledChunk.local_page_ids`); the runner packs a second page
table and slot list for the sliding layers, whose K/V live in their own pages
(`jserve.runtime.kv_cache.init_kv_pages(local_pages=)`). The kernels read either table the same
way: the sliding layers mask by position, so the null page in place of a page given back is
never read.

Prefix caching: both tables index their full pages under the same chained hashes; a hit is the
longest prefix that both allow (the full table: every page cached; the sliding table: the pages
of the last window cached, vLLM's rule), found by asking the full table first and the sliding
table no further than the full table's hit.

`split_pages` divides one pool's memory between the two: by what a sequence of the planned
context holds in each (the full layers every page, the sliding ones a window and a prefill
chunk), so that both run short at the same number of such sequences.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence

from jserve.core.page_table import PageTable, _as_token_ids, _cdiv


def split_pages(num_pages: int, *, num_layers: int, sliding_layers: int, page_size: int, context: int,
                window: int, max_chunk: int) -> tuple[int, int] | None:
    """`(full_pages, sliding_pages)`, each including its null page, that take no more memory than
    `num_pages` pages of every layer (`num_layers * num_pages` layer-pages), split so that both
    pools hold as many sequences of `context` tokens; None where a window holds as many pages as
    the context (nothing to gain) or the pools would not hold one such sequence."""
    full_layers = num_layers - sliding_layers
    if not 0 < sliding_layers < num_layers or num_pages < 2:
        return None
    full = _cdiv(context, page_size)
    win = min(full, _cdiv(window - 1 + max_chunk, page_size) + 1)  # `PageTable.window_pages`
    if win >= full:
        return None
    layer_pages = num_layers * num_pages
    per_sequence = full_layers * full + sliding_layers * win
    sequences = (layer_pages - num_layers) / per_sequence  # each pool's null page aside
    local = max(int(sequences * win), win) + 1
    glob = (layer_pages - sliding_layers * local) // full_layers
    if glob - 1 < full:
        return None
    return glob, local


class HybridPageTable:
    """A full table (`self.full`) and a sliding one (`self.local`, pages behind `sliding_window`
    given back), driven in step; `PageTable`'s interface (see the module's notes). What only
    reads (counts, the pool, the prefix counters) is the full table's."""

    def __init__(self, num_pages: int, num_local_pages: int, page_size: int = 16, *, sliding_window: int,
                 enable_prefix_caching: bool = False):
        self.full = PageTable(num_pages, page_size, enable_prefix_caching=enable_prefix_caching)
        self.local = PageTable(num_local_pages, page_size, enable_prefix_caching=enable_prefix_caching,
                               sliding_window=sliding_window)
        self.tables = (self.full, self.local)
        self.pool = self.full.pool
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = None  # of the full table: no window every layer shares

    def __getattr__(self, name: str):
        # The full table's reads: page_ids, num_tokens, num_allocated_tokens, num_computed_tokens,
        # num_requests, window_pages and the prefix counters.
        if name in _READS:
            return getattr(self.full, name)
        raise AttributeError(name)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self.full

    @property
    def num_window_released_pages(self) -> int:
        return self.local.num_window_released_pages

    def local_page_ids(self, request_id: Hashable) -> list[int]:
        return self.local.page_ids(request_id)

    def max_tokens(self, max_chunk: int, max_model_len: int) -> int:
        return min(t.max_tokens(max_chunk, max_model_len) for t in self.tables)

    # Admission: the hit both tables allow.

    def _hit_pages(self, token_ids: list[int], cache_salt: str | None) -> int:
        if not self.enable_prefix_caching:
            return 0
        full = len(self.full._cached_prefix(token_ids, cache_salt)[1])
        return len(self.local._cached_prefix(token_ids, cache_salt, full)[1])

    def lookup_prefix(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> int:
        return self._hit_pages(_as_token_ids(token_ids), cache_salt) * self.page_size

    def can_allocate_prompt(self, token_ids: Sequence[int], *, num_new_tokens: int | None = None,
                            cache_salt: str | None = None) -> bool:
        token_ids = _as_token_ids(token_ids)
        hit = self._hit_pages(token_ids, cache_salt)
        return all(t._plan_prompt(token_ids, num_new_tokens, cache_salt, hit).fits for t in self.tables)

    def allocate_prompt(self, request_id: Hashable, token_ids: Sequence[int], *,
                        num_new_tokens: int | None = None, cache_salt: str | None = None) -> int | None:
        """`PageTable.allocate_prompt` on both tables, sharing the hit both allow; None (nothing
        changed) when either pool is short."""
        if request_id in self.full:
            raise ValueError(f"duplicate request id {request_id!r}")
        token_ids = _as_token_ids(token_ids)
        hit = self._hit_pages(token_ids, cache_salt)
        if not all(t._plan_prompt(token_ids, num_new_tokens, cache_salt, hit).fits for t in self.tables):
            return None
        cached = [t.allocate_prompt(request_id, token_ids, num_new_tokens=num_new_tokens, cache_salt=cache_salt,
                                    max_cached_pages=hit) for t in self.tables]
        assert cached == [hit * self.page_size] * 2, (cached, hit)
        return cached[0]

    # Growth and release: both tables, in step.

    def append_tokens(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        for t in self.tables:
            t.append_tokens(request_id, token_ids)

    def set_token(self, request_id: Hashable, index: int, token_id: int) -> None:
        for t in self.tables:
            t.set_token(request_id, index, token_id)

    def can_allocate_slots(self, request_id: Hashable, num_new_tokens: int, *, num_lookahead: int = 0) -> bool:
        return all(t.can_allocate_slots(request_id, num_new_tokens, num_lookahead=num_lookahead)
                   for t in self.tables)

    def num_fresh_pages(self, request_id: Hashable, num_new_tokens: int, *, num_lookahead: int = 0) -> int:
        """Pages `allocate_slots` would take from the two pools, together."""
        return sum(t.num_fresh_pages(request_id, num_new_tokens, num_lookahead=num_lookahead) for t in self.tables)

    def can_allocate_lookahead(self, requests: Sequence[tuple[Hashable, int]]) -> bool:
        return all(t.can_allocate_lookahead(requests) for t in self.tables)

    def allocate_slots(self, request_id: Hashable, num_new_tokens: int, *, num_lookahead: int = 0) -> bool:
        if not self.can_allocate_slots(request_id, num_new_tokens, num_lookahead=num_lookahead):
            return False
        for t in self.tables:
            allocated = t.allocate_slots(request_id, num_new_tokens, num_lookahead=num_lookahead)
            assert allocated, "both pools were asked first"
        return True

    def mark_computed(self, request_id: Hashable, num_new_tokens: int) -> None:
        for t in self.tables:
            t.mark_computed(request_id, num_new_tokens)

    def release_lookahead(self, request_id: Hashable) -> int:
        """Pages past the known tokens given back: the full table's count (the sliding table's
        lookahead pages go back too)."""
        return [t.release_lookahead(request_id) for t in self.tables][0]

    def reset_prefix_cache(self) -> int:
        return sum(t.reset_prefix_cache() for t in self.tables)

    def free(self, request_id: Hashable) -> None:
        for t in self.tables:
            t.free(request_id)

    def check_invariants(self, pinned: collections.Counter | None = None) -> None:
        self.full.check_invariants(pinned)
        self.local.check_invariants()
        full, local = self.full._seqs, self.local._seqs
        assert set(full) == set(local), "the tables hold different requests"
        for rid, seq in full.items():
            other = local[rid]
            assert (seq.token_ids, seq.num_computed, seq.num_allocated) == (
                other.token_ids, other.num_computed, other.num_allocated), f"{rid!r}: the tables disagree"
            assert len(seq.page_ids) == len(other.page_ids), f"{rid!r}: lists of different lengths"


_READS = frozenset({"page_ids", "num_tokens", "num_allocated_tokens", "num_computed_tokens", "num_requests",
                    "window_pages", "num_prefix_queries", "num_prefix_query_tokens", "num_prefix_hit_tokens",
                    "num_prefix_resets"})

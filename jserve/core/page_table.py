"""Page table: the KV-cache pages each request owns, with refcounts and a prefix cache.

Pure Python (neither jax nor numpy): the scheduler drives it, the runner only reads `page_ids()`.
The pages themselves (free, used, cached; the null page 0) are `jserve.core.page_pool.PagePool`'s.
`PageTable`'s docstring is the scheduler's contract (admit, allocate, mark computed, append, free;
lookahead pages for multi-step decode and speculative drafts; pages given back behind a sliding
window). See docs/architecture.md, "One request, from HTTP to the kernel and back".
"""

import collections
import dataclasses
import operator
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

from jserve.core.page_pool import NULL_PAGE, PagePool, check_count, hash_page, iter_page_hashes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _as_token_ids(token_ids: Iterable[int]) -> list[int]:
    # Plain ints: a numpy int would hash (repr) differently from the same Python int.
    return [operator.index(t) for t in token_ids]


@dataclasses.dataclass
class _Sequence:
    """One request's view: its tokens and the pages holding their K/V, in order."""

    token_ids: list[int]
    cache_salt: str | None
    page_ids: list[int]
    num_computed: int
    num_allocated: int
    page_hashes: list[bytes]  # chained hashes of the full computed pages (prefix caching only)
    num_released: int = 0  # leading pages given back behind the sliding window (now the null page)


class _PromptPlan(NamedTuple):
    token_ids: list[int]
    cached_hashes: list[bytes]
    cached_pages: list[int]
    num_new_tokens: int
    num_fresh_pages: int
    fits: bool


class PageTable:
    """Per-request page lists over a `PagePool`: admission with prefix reuse, growth, fork, free.

    `PageTable` keeps three counts per request, `num_computed_tokens <= num_allocated_tokens <=
    num_tokens`: tokens whose K/V is written, tokens that have a slot, tokens known (prompt + sampled).
    The scheduler's contract:

    1. Admit: `n = lookup_prefix(prompt, cache_salt=salt)` says how many leading tokens are cached;
       pick a chunk `k <= len(prompt) - n` and call `allocate_prompt(rid, prompt, num_new_tokens=k,
       cache_salt=salt)`. It shares the cached pages (they count as computed) and gives slots to the
       next `k` tokens. None means the pool is short and nothing changed (`can_allocate_prompt` asks).
    2. Each step, for `k` more known tokens to compute: `allocate_slots(rid, k)`. False: short,
       nothing changed (preempt someone).
    3. After the step ran: `mark_computed(rid, k)`. Pages that are now full and computed enter the
       prefix cache under sha256(parent page hash, the page's token ids, cache salt): tenants with
       different salts never share a page.
    4. After sampling: `append_tokens(rid, [token])`; its slot comes with the next `allocate_slots`.
    5. `free(rid)` on finish, abort or preemption (re-admit with prompt + output as the prompt; the
       prefix cache saves the recompute).

    Pages are shared only through the prefix cache, and only full ones: a write never lands in a
    shared page, so nothing is ever copied on write (parallel samples share their prompt's full
    pages through the cache and compute their own last partial page).

    Lookahead (multi-step decode): `allocate_slots(rid, 1, num_lookahead=n - 1)` also takes the pages
    for the `n - 1` tokens the device will sample and feed back within one call, before they are
    known. The request then holds pages past its allocated slots; each later step's
    `allocate_slots(rid, 1)` (after `append_tokens`) finds its slot in them and takes no page. Pages
    held past the slots are released with the others by `free`, or by `release_lookahead`.

    Speculative decoding takes lookahead pages the same way for a step's draft tokens
    (`allocate_slots(rid, 0, num_lookahead=m)` after the step's own slot); the drafts its samples
    confirm become slots one by one (`append_tokens`, `allocate_slots(rid, 1)`, `mark_computed`), and
    `release_lookahead` gives back the pages of those it rejected.

    Sliding window (`sliding_window`: every layer attends to the last `sliding_window` positions
    only, as Mistral's and Phi-3's do): once a request has computed past a page by the window, no
    later query of it reads that page (a query at q reads keys k > q - window), so `mark_computed`
    gives the page back and puts the null page in its place in the request's list; the attention
    masks that place out by position. The list keeps its length (slot `i` is still page
    `i // page_size`). With prefix caching a full page given back stays cached until evicted, and a
    hit needs only the pages inside the last window of the cached prefix (earlier ones may be
    evicted: they are the null page in its list, as if given back). A model whose layers
    differ (Gemma's full and sliding layers share each page) keeps every page.

    A request always computes at least its last prompt token, and writes never touch a cached page:
    so a prompt of `m` full pages, all cached, reuses `m - 1` of them and recomputes the last page
    (as vLLM does) rather than copying a cached page to rewrite one slot of it.
    """

    def __init__(self, num_pages: int, page_size: int = 16, *, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None):
        """`sliding_window`: the window every layer of the model attends through (None: some layer
        sees every position): pages behind it are given back as requests compute past them."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        self.pool = PagePool(num_pages, page_size)
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.num_window_released_pages = 0  # pages given back behind the sliding window, in all
        self._seqs: dict[Hashable, _Sequence] = {}
        # Prefix-cache counters, counted at successful admission: hit rate = hit / query tokens.
        self.num_prefix_queries = 0
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_prefix_resets = 0

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._seqs

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    def _seq(self, request_id: Hashable) -> _Sequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise ValueError(f"unknown request id {request_id!r}")
        return seq

    def page_ids(self, request_id: Hashable) -> list[int]:
        """The request's pages in token order (a copy); slot `i` is page `i // page_size`."""
        return list(self._seq(request_id).page_ids)

    def local_page_ids(self, request_id: Hashable) -> list[int] | None:
        """The sliding layers' own pages (`jserve.core.hybrid_pages`); None: every layer reads `page_ids`."""
        return None

    def max_tokens(self, max_chunk: int, max_model_len: int) -> int:
        """The most tokens one request can hold alone: the pool's, or any length (`max_model_len`)
        where pages behind the window go back and a window's worth fits."""
        held = self.window_pages(max_chunk)
        if held is not None and held <= self.pool.num_pages - 1:
            return max_model_len
        return (self.pool.num_pages - 1) * self.page_size

    def num_tokens(self, request_id: Hashable) -> int:
        return len(self._seq(request_id).token_ids)

    def num_allocated_tokens(self, request_id: Hashable) -> int:
        return self._seq(request_id).num_allocated

    def num_computed_tokens(self, request_id: Hashable) -> int:
        return self._seq(request_id).num_computed

    # Admission.

    def lookup_prefix(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> int:
        """How many leading tokens of a prompt are cached: whole pages, never the last token."""
        return len(self._cached_prefix(_as_token_ids(token_ids), cache_salt)[1]) * self.page_size

    def _cached_prefix(self, token_ids: list[int], cache_salt: str | None,
                       max_pages: int | None = None) -> tuple[list[bytes], list[int]]:
        """The cached prefix's hashes and pages, at most `max_pages` of them (None: no limit)."""
        hashes, pages = [], []
        if self.enable_prefix_caching and self.sliding_window is not None:
            return self._cached_window_prefix(token_ids, cache_salt, max_pages)
        if self.enable_prefix_caching:
            for page_hash in iter_page_hashes(token_ids[:-1], self.page_size, cache_salt):
                page = self.pool.cached_page(page_hash)
                if page is None or len(pages) == max_pages:
                    break
                hashes.append(page_hash)
                pages.append(page)
        return hashes, pages

    def _cached_window_prefix(self, token_ids: list[int], cache_salt: str | None,
                              max_pages: int | None = None) -> tuple[list[bytes], list[int]]:
        """The longest hit whose last window of pages is cached (vLLM's sliding-window rule): the
        queries after a hit of L tokens read keys > L - window only, so earlier pages, evicted or
        not, are the null page in the hit's list (as if given back behind the window)."""
        hashes = list(iter_page_hashes(token_ids[:-1], self.page_size, cache_salt))[:max_pages]
        need = max(1, _cdiv(self.sliding_window - 1, self.page_size))  # pages holding keys L-window+1..L-1
        run = end = 0
        for i in range(len(hashes) - 1, -1, -1):  # longest first: scan back for `need` cached pages in a row
            run = run + 1 if self.pool.cached_page(hashes[i]) is not None else 0
            if run >= need:
                end = i + run
                break
        else:
            end = run  # fewer than a window's pages, all from the first: the hit needs each of them
        dead = max(0, (end * self.page_size - self.sliding_window + 1) // self.page_size)
        pages = [NULL_PAGE] * dead + [self.pool.cached_page(h) for h in hashes[dead:end]]
        return hashes[:end], pages

    def _plan_prompt(self, token_ids: Iterable[int], num_new_tokens: int | None,
                     cache_salt: str | None, max_cached_pages: int | None = None) -> _PromptPlan:
        token_ids = _as_token_ids(token_ids)
        if not token_ids:
            raise ValueError("token_ids is empty: a prompt needs at least one token")
        hashes, pages = self._cached_prefix(token_ids, cache_salt, max_cached_pages)
        num_cached = len(pages) * self.page_size
        num_uncached = len(token_ids) - num_cached
        if num_new_tokens is None:
            num_new_tokens = num_uncached
        elif not 0 <= num_new_tokens <= num_uncached:
            raise ValueError(f"num_new_tokens={num_new_tokens} outside [0, {num_uncached}]: "
                             f"{len(token_ids)} prompt tokens, {num_cached} cached")
        num_fresh = _cdiv(num_cached + num_new_tokens, self.page_size) - len(pages)
        # Cached idle pages taken now can no longer be evicted to make room for the fresh ones.
        num_idle = sum(page != NULL_PAGE and self.pool.refcount(page) == 0 for page in pages)
        fits = num_fresh + num_idle <= self.pool.num_available_pages
        return _PromptPlan(token_ids, hashes, pages, num_new_tokens, num_fresh, fits)

    def can_allocate_prompt(self, token_ids: Sequence[int], *, num_new_tokens: int | None = None,
                            cache_salt: str | None = None) -> bool:
        """Whether `allocate_prompt` with these arguments would succeed now."""
        return self._plan_prompt(token_ids, num_new_tokens, cache_salt).fits

    def allocate_prompt(self, request_id: Hashable, token_ids: Sequence[int], *,
                        num_new_tokens: int | None = None, cache_salt: str | None = None,
                        max_cached_pages: int | None = None) -> int | None:
        """Admits a request: shares its cached prefix pages and gives slots to `num_new_tokens` more.

        Args:
          token_ids: the prompt (after a preemption: prompt + output so far).
          num_new_tokens: tokens after the cached prefix to give slots to now (the first chunk);
            None: all of them. At most `len(token_ids) - lookup_prefix(token_ids)`.
          cache_salt: per-tenant salt mixed into every page hash.
          max_cached_pages: share at most this many cached pages (None: the whole hit).
        Returns:
          The number of cached tokens (already computed; may be 0), or None when the pool is short,
          in which case nothing changed.
        """
        if request_id in self._seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        plan = self._plan_prompt(token_ids, num_new_tokens, cache_salt, max_cached_pages)
        if not plan.fits:
            return None
        num_null = plan.cached_pages.count(NULL_PAGE)  # leading: behind the window of a hit past it
        for page in plan.cached_pages[num_null:]:
            self.pool.share(page)
        fresh = self.pool.allocate(plan.num_fresh_pages)
        assert fresh is not None, "plan said the pages fit"
        num_cached = len(plan.cached_pages) * self.page_size
        self._seqs[request_id] = _Sequence(
            token_ids=plan.token_ids, cache_salt=cache_salt, page_ids=plan.cached_pages + fresh,
            num_computed=num_cached, num_allocated=num_cached + plan.num_new_tokens,
            page_hashes=plan.cached_hashes, num_released=num_null)
        if self.sliding_window is not None:  # a cached prefix longer than the window
            self._release_behind_window(self._seqs[request_id])
        if self.enable_prefix_caching:
            self.num_prefix_queries += 1
            self.num_prefix_query_tokens += len(plan.token_ids)
            self.num_prefix_hit_tokens += num_cached
        return num_cached

    # Growth.

    def append_tokens(self, request_id: Hashable, token_ids: Sequence[int]) -> None:
        """Adds known tokens (sampled ones); they get slots with a later `allocate_slots`."""
        self._seq(request_id).token_ids.extend(_as_token_ids(token_ids))

    def set_token(self, request_id: Hashable, index: int, token_id: int) -> None:
        """Replace the known token at `index` (a placeholder appended before its value was known:
        async scheduling); it must not be in a hashed page yet."""
        seq = self._seq(request_id)
        if not 0 <= index < len(seq.token_ids):
            raise ValueError(f"token index {index} is outside the {len(seq.token_ids)} tokens of {request_id!r}")
        if index < len(seq.page_hashes) * self.page_size:
            raise ValueError(f"token {index} of {request_id!r} is in a page already in the prefix cache")
        seq.token_ids[index] = int(token_id)

    def _plan_slots(self, seq: _Sequence, num_new_tokens: int, num_lookahead: int = 0) -> int:
        """Fresh pages needed for `num_new_tokens` more slots (and `num_lookahead` after them)."""
        check_count("num_new_tokens", num_new_tokens)
        check_count("num_lookahead", num_lookahead)
        num_unallocated = len(seq.token_ids) - seq.num_allocated
        if num_new_tokens > num_unallocated:
            raise ValueError(f"num_new_tokens={num_new_tokens} exceeds the {num_unallocated} known "
                             "tokens without a slot (append_tokens first)")
        num_pages = _cdiv(seq.num_allocated + num_new_tokens + num_lookahead, self.page_size)
        return max(0, num_pages - len(seq.page_ids))

    def can_allocate_slots(self, request_id: Hashable, num_new_tokens: int, *, num_lookahead: int = 0) -> bool:
        """Whether `allocate_slots` with these arguments would succeed now."""
        return self.num_fresh_pages(request_id, num_new_tokens, num_lookahead=num_lookahead) <= (
            self.pool.num_available_pages)

    def num_fresh_pages(self, request_id: Hashable, num_new_tokens: int, *, num_lookahead: int = 0) -> int:
        """Pages `allocate_slots` with these arguments would take from the pool."""
        return self._plan_slots(self._seq(request_id), num_new_tokens, num_lookahead)

    def can_allocate_lookahead(self, requests: Sequence[tuple[Hashable, int]]) -> bool:
        """Whether each `(request_id, n)` can take one more slot and `n` lookahead slots at once."""
        need = sum(self.num_fresh_pages(rid, 1, num_lookahead=n) for rid, n in requests)
        return need <= self.pool.num_available_pages

    def allocate_slots(self, request_id: Hashable, num_new_tokens: int, *,
                       num_lookahead: int = 0) -> bool:
        """Gives slots to the next `num_new_tokens` known tokens, adding pages as needed; False
        (and nothing changed) when the pool is short.

        `num_lookahead` more slots' pages are taken too, for tokens not known yet (multi-step
        decode): they become slots with later `allocate_slots` calls, after `append_tokens`.
        """
        seq = self._seq(request_id)
        fresh = self.pool.allocate(self._plan_slots(seq, num_new_tokens, num_lookahead))
        if fresh is None:
            return False
        seq.page_ids.extend(fresh)
        seq.num_allocated += num_new_tokens
        return True

    def mark_computed(self, request_id: Hashable, num_new_tokens: int) -> None:
        """Records that the step wrote K/V for the next `num_new_tokens` allocated tokens.

        With prefix caching, pages now full and computed enter the prefix cache.
        """
        seq = self._seq(request_id)
        check_count("num_new_tokens", num_new_tokens)
        num_pending = seq.num_allocated - seq.num_computed
        if num_new_tokens > num_pending:
            raise ValueError(f"num_new_tokens={num_new_tokens} exceeds the {num_pending} allocated, "
                             "uncomputed tokens")
        seq.num_computed += num_new_tokens
        size = self.page_size
        if self.enable_prefix_caching:
            for i in range(len(seq.page_hashes), seq.num_computed // size):
                parent = seq.page_hashes[-1] if seq.page_hashes else None
                page_hash = hash_page(parent, seq.token_ids[i * size:(i + 1) * size], seq.cache_salt)
                seq.page_hashes.append(page_hash)
                # False when another page already holds this prefix: that one stays the cached copy.
                self.pool.register(seq.page_ids[i], page_hash)
        if self.sliding_window is not None:
            self._release_behind_window(seq)

    def _behind_window(self, seq: _Sequence) -> int:
        """How many leading pages no later query of `seq` reads: a query at q >= num_computed
        reads keys k > q - sliding_window, so page i, whose last key is (i + 1) * page_size - 1,
        is read by none once that key is <= num_computed - sliding_window."""
        reach = seq.num_computed - self.sliding_window + 1  # keys below it are read by no later query
        return min(len(seq.page_ids), max(0, reach // self.page_size))

    def window_pages(self, max_chunk: int) -> int | None:
        """The most pages a request holds at once while computing chunks of at most `max_chunk`
        tokens, pages behind the window given back (None: no window, it keeps every page)."""
        if self.sliding_window is None:
            return None
        return _cdiv(self.sliding_window - 1 + max_chunk, self.page_size) + 1

    def _release_behind_window(self, seq: _Sequence) -> None:
        dead = self._behind_window(seq)
        if dead > seq.num_released:
            pages = seq.page_ids[seq.num_released:dead]
            seq.page_ids[seq.num_released:dead] = [NULL_PAGE] * len(pages)
            seq.num_released = dead
            self.num_window_released_pages += len(pages)
            self.pool.release(reversed(pages))

    def release_lookahead(self, request_id: Hashable) -> int:
        """Gives back the request's pages past those its known tokens need (a speculative step's
        pages for rejected drafts); returns how many. Their slots were never allocated, so nothing
        indexes them and the K/V the step wrote there is never read."""
        seq = self._seq(request_id)
        keep = max(_cdiv(len(seq.token_ids), self.page_size), _cdiv(seq.num_allocated, self.page_size))
        extra = seq.page_ids[keep:]
        if extra:
            del seq.page_ids[keep:]
            self.pool.release(reversed(extra))
        return len(extra)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (new weights: the pages' K/V are stale): cached pages are
        freed, and the live requests' pages, present and later, are salted apart so that no other
        request ever shares them. Returns the pages freed."""
        self.num_prefix_resets += 1
        for request_id, seq in self._seqs.items():
            seq.cache_salt = f"{seq.cache_salt or ''}\x00reset-{self.num_prefix_resets}-{request_id}"
        return self.pool.forget_prefixes()

    # Release.

    def free(self, request_id: Hashable) -> None:
        """Releases the request's pages; cached prefix pages stay reusable until evicted."""
        seq = self._seq(request_id)
        del self._seqs[request_id]
        # Last page first: a prefix's tail is evicted before its head, which every reuse needs.
        self.pool.release(reversed(seq.page_ids[seq.num_released:]))

    def check_invariants(self, pinned: collections.Counter | None = None) -> None:
        """Asserts the bookkeeping is consistent (tests call it after every operation); `pinned`:
        owners of pages beside the requests (a host tier's copies in flight)."""
        owners = collections.Counter(pinned)
        for request_id, seq in self._seqs.items():
            assert 0 <= seq.num_computed <= seq.num_allocated <= len(seq.token_ids), request_id
            # Pages past the slots are lookahead pages (multi-step decode): never indexed.
            assert len(seq.page_ids) >= _cdiv(seq.num_allocated, self.page_size), request_id
            held = seq.page_ids[seq.num_released:]
            # Given back behind the window: exactly the pages no later query reads, none held.
            assert seq.num_released == (0 if self.sliding_window is None else self._behind_window(seq)), request_id
            assert set(seq.page_ids[:seq.num_released]) <= {NULL_PAGE}, f"{request_id!r} kept a page behind the window"
            assert len(set(held)) == len(held), f"{request_id!r} holds a page twice"
            owners.update(held)
            expected = (list(iter_page_hashes(seq.token_ids[:seq.num_computed], self.page_size,
                                              seq.cache_salt)) if self.enable_prefix_caching else [])
            assert seq.page_hashes == expected, f"{request_id!r}: stale page hashes"
            for i, page in enumerate(seq.page_ids[seq.num_released:], seq.num_released):
                page_hash = self.pool.page_hash(page)
                # An indexed page is full and computed for every owner, so no write ever reaches it.
                assert page_hash is None or page_hash == (seq.page_hashes[i:i + 1] or [None])[0], (
                    f"{request_id!r}: page {page} at index {i} is indexed under another prefix")
        self.pool.check_invariants(owners)

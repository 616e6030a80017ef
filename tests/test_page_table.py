"""jserve.core.page_table: a unit test per behaviour (the state machine: test_page_table_machine.py)."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jserve.core.page_pool import NULL_PAGE, PagePool
from jserve.core.page_table import PageTable


def snapshot(pt: PageTable):
    """Everything a failed allocation must leave unchanged."""
    pool = pt.pool
    return (list(pool._free), list(pool._cached), list(pool._refcounts), dict(pool._page_by_hash),
            pool.num_evicted_pages, pt.num_prefix_queries, pt.num_prefix_hit_tokens,
            {rid: dataclasses.astuple(seq) for rid, seq in pt._seqs.items()})


def run_prompt(pt: PageTable, rid, tokens, *, cache_salt=None) -> int:
    """Admits and fully computes a prompt; returns the number of cached tokens."""
    num_cached = pt.allocate_prompt(rid, tokens, cache_salt=cache_salt)
    assert num_cached is not None
    pt.mark_computed(rid, len(tokens) - num_cached)
    pt.check_invariants()
    return num_cached


# Argument checking.

@pytest.mark.parametrize("num_pages, page_size, match", [(1, 16, "num_pages"), (0, 16, "num_pages"),
                                                         (4, 0, "page_size"), (4, -2, "page_size")])
def test_bad_constructor_arguments(num_pages, page_size, match):
    with pytest.raises(ValueError, match=match):
        PageTable(num_pages, page_size)


def test_bad_request_arguments():
    pt = PageTable(8, 4)
    pt.allocate_prompt("a", [1, 2, 3, 4, 5])
    for call in (lambda: pt.page_ids("x"), lambda: pt.free("x"), lambda: pt.allocate_slots("x", 1),
                 lambda: pt.mark_computed("x", 1), lambda: pt.num_tokens("x"),
                 lambda: pt.append_tokens("x", [1]), lambda: pt.can_allocate_slots("x", 1)):
        with pytest.raises(ValueError, match="'x'"):
            call()
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        pt.allocate_prompt("a", [1])
    with pytest.raises(ValueError, match="-1"):
        pt.allocate_slots("a", -1)
    with pytest.raises(ValueError, match="-1"):
        pt.mark_computed("a", -1)
    with pytest.raises(ValueError, match="num_new_tokens=6"):
        pt.mark_computed("a", 6)
    with pytest.raises(ValueError, match="num_new_tokens=1"):
        pt.allocate_slots("a", 1)  # no known token without a slot
    with pytest.raises(ValueError, match="num_new_tokens=3"):
        pt.allocate_prompt("b", [1, 2], num_new_tokens=3)
    with pytest.raises(ValueError, match="num_new_tokens=-1"):
        pt.can_allocate_prompt([1, 2], num_new_tokens=-1)
    with pytest.raises(ValueError, match="empty"):
        pt.allocate_prompt("b", [])
    pt.mark_computed("a", 5)
    with pytest.raises(ValueError, match="num_pages"):
        pt.pool.evict(-1)
    pt.check_invariants()


# Pages and refcounts.

def test_null_page_never_handed_out():
    pool = PagePool(5, 2)
    pages = pool.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4] and NULL_PAGE not in pages
    assert pool.allocate(1) is None
    assert pool.num_used_pages == 4 and pool.num_free_pages == 0


def test_pages_grow_with_tokens():
    pt = PageTable(10, 4)
    assert pt.allocate_prompt("a", range(6), num_new_tokens=3) == 0
    assert len(pt.page_ids("a")) == 1 and pt.num_allocated_tokens("a") == 3 and pt.num_tokens("a") == 6
    assert pt.allocate_slots("a", 3) is True
    assert len(pt.page_ids("a")) == 2
    pt.mark_computed("a", 6)
    pt.append_tokens("a", [7, 8, 9])
    assert pt.allocate_slots("a", 3) is True
    assert len(pt.page_ids("a")) == 3 and pt.num_computed_tokens("a") == 6
    assert pt.allocate_slots("a", 0) is True
    assert pt.pool.num_used_pages == 3
    pt.check_invariants()


def test_slots_need_pages():
    pt = PageTable(3, 4)
    run_prompt(pt, "p", range(8))
    pt.append_tokens("p", [1])
    assert not pt.can_allocate_slots("p", 1)
    before = snapshot(pt)
    assert pt.allocate_slots("p", 1) is False
    assert snapshot(pt) == before
    pt.check_invariants()


# Prefix caching.

def test_prefix_hit_after_free():
    pt = PageTable(10, 4, enable_prefix_caching=True)
    prompt = list(range(10))  # 2 full pages + 2 tokens
    run_prompt(pt, "a", prompt)
    pages = pt.page_ids("a")
    pt.free("a")
    pt.check_invariants()
    assert pt.pool.num_cached_pages == 2 and pt.pool.num_free_pages == 7
    assert pt.lookup_prefix(prompt) == 8
    assert pt.lookup_prefix(prompt[:8] + [99]) == 8
    assert pt.lookup_prefix(prompt[:4] + [99] * 6) == 4
    assert pt.lookup_prefix([99] + prompt[1:]) == 0
    assert pt.allocate_prompt("b", prompt + [5, 5]) == 8
    assert pt.page_ids("b")[:2] == pages[:2]
    assert pt.num_computed_tokens("b") == 8 and pt.num_allocated_tokens("b") == 12
    assert pt.pool.num_cached_pages == 0 and pt.pool.num_used_pages == 3
    assert (pt.num_prefix_queries, pt.num_prefix_query_tokens, pt.num_prefix_hit_tokens) == (2, 22, 8)
    pt.check_invariants()


def test_live_requests_share_a_computed_prefix():
    pt = PageTable(10, 4, enable_prefix_caching=True)
    run_prompt(pt, "a", range(9))
    assert pt.allocate_prompt("b", list(range(8)) + [7, 7, 7]) == 8
    assert pt.page_ids("b")[:2] == pt.page_ids("a")[:2]
    assert [pt.pool.refcount(page) for page in pt.page_ids("a")] == [2, 2, 1]
    pt.check_invariants()


def test_fully_cached_prompt_recomputes_its_last_page():
    pt = PageTable(10, 4, enable_prefix_caching=True)
    run_prompt(pt, "a", range(8))
    pt.free("a")
    assert pt.lookup_prefix(range(8)) == 4
    assert pt.lookup_prefix(range(9)) == 8
    assert pt.allocate_prompt("b", range(8)) == 4
    assert pt.num_allocated_tokens("b") == 8
    pt.check_invariants()
    assert pt.lookup_prefix(range(1)) == 0


def test_only_full_computed_pages_are_cached():
    pt = PageTable(10, 4, enable_prefix_caching=True)
    pt.allocate_prompt("a", range(12), num_new_tokens=6)
    assert pt.lookup_prefix(range(13)) == 0  # slots given, nothing computed yet
    pt.mark_computed("a", 3)
    assert pt.lookup_prefix(range(13)) == 0
    pt.mark_computed("a", 3)
    assert pt.lookup_prefix(range(13)) == 4  # page 1 holds 2 of 4 computed tokens
    pt.allocate_slots("a", 6)
    pt.mark_computed("a", 6)
    assert pt.lookup_prefix(range(13)) == 12
    pt.check_invariants()


def test_cache_salt_isolates_tenants():
    pt = PageTable(16, 4, enable_prefix_caching=True)
    prompt = list(range(9))
    run_prompt(pt, "a", prompt, cache_salt="tenant-a")
    assert pt.lookup_prefix(prompt, cache_salt="tenant-a") == 8
    assert pt.lookup_prefix(prompt, cache_salt="tenant-b") == 0
    assert pt.lookup_prefix(prompt) == 0
    assert run_prompt(pt, "b", prompt, cache_salt="tenant-b") == 0
    assert not set(pt.page_ids("a")) & set(pt.page_ids("b"))
    assert run_prompt(pt, "c", prompt, cache_salt="tenant-a") == 8
    assert run_prompt(pt, "d", prompt) == 0


def test_prefix_caching_disabled():
    pt = PageTable(10, 4)
    run_prompt(pt, "a", range(9))
    pt.free("a")
    assert pt.lookup_prefix(range(9)) == 0 and pt.pool.num_cached_pages == 0
    assert run_prompt(pt, "b", range(9)) == 0
    assert pt.num_prefix_queries == 0


def test_duplicate_prefix_is_cached_once():
    pt = PageTable(10, 4, enable_prefix_caching=True)
    for rid in "ab":  # both admitted before either computed: both miss
        assert pt.allocate_prompt(rid, range(5)) == 0
    for rid in "ab":
        pt.mark_computed(rid, 5)
    pt.check_invariants()
    pt.free("a")
    pt.free("b")
    pt.check_invariants()
    assert pt.pool.num_cached_pages == 1 and pt.lookup_prefix(range(5)) == 4


def test_lru_eviction_order():
    pt = PageTable(7, 2, enable_prefix_caching=True)
    prompts = {rid: [i, i, 9] for i, rid in enumerate("abc")}  # one cacheable page each
    for rid, prompt in prompts.items():
        run_prompt(pt, rid, prompt)
    for rid in "abc":
        pt.free(rid)
    assert pt.pool.num_cached_pages == 3 and pt.pool.num_free_pages == 3
    # Reusing "a" makes it the most recently used.
    run_prompt(pt, "a2", prompts["a"])
    pt.free("a2")
    pt.check_invariants()
    assert pt.allocate_prompt("x", [5] * 8) == 0  # 4 pages: the 3 free ones, then evicts "b"
    pt.check_invariants()
    assert [pt.lookup_prefix(prompts[rid]) for rid in "abc"] == [2, 0, 2]
    assert pt.pool.evict(1) == 1  # then "c"
    assert [pt.lookup_prefix(prompts[rid]) for rid in "abc"] == [2, 0, 0]
    assert pt.pool.evict() == 1 and pt.pool.num_cached_pages == 0 and pt.pool.num_evicted_pages == 3


def test_freed_request_evicts_its_tail_first():
    pt = PageTable(10, 2, enable_prefix_caching=True)
    run_prompt(pt, "a", range(7))  # 3 cacheable pages
    pt.free("a")
    assert pt.pool.evict(1) == 1
    assert pt.lookup_prefix(range(7)) == 4
    assert pt.pool.evict(1) == 1
    assert pt.lookup_prefix(range(7)) == 2
    pt.check_invariants()


def test_allocation_failure_leaves_state_unchanged():
    pt = PageTable(6, 4, enable_prefix_caching=True)
    run_prompt(pt, "a", range(9))  # 3 pages; 2 full pages indexed
    pt.free("a")
    run_prompt(pt, "b", [50] * 9)  # takes the 3 free pages: 2 cached pages left, none free
    before = snapshot(pt)
    assert not pt.can_allocate_prompt(range(20), num_new_tokens=12)
    assert pt.allocate_prompt("c", range(20), num_new_tokens=12) is None
    assert snapshot(pt) == before
    # 8 cached tokens: their 2 pages cannot be both shared and evicted for the 2 fresh pages needed.
    assert pt.lookup_prefix(range(20)) == 8
    assert not pt.can_allocate_prompt(range(20), num_new_tokens=5)
    assert pt.allocate_prompt("c", range(20), num_new_tokens=5) is None
    assert snapshot(pt) == before
    pt.append_tokens("b", range(12))
    before = snapshot(pt)
    assert not pt.can_allocate_slots("b", 12)  # 3 more pages
    assert pt.allocate_slots("b", 12) is False
    assert snapshot(pt) == before
    assert pt.can_allocate_prompt(range(20), num_new_tokens=0)
    assert pt.allocate_prompt("c", range(20), num_new_tokens=0) == 8
    pt.check_invariants()


def test_freeing_everything_returns_every_page():
    pt = PageTable(20, 4, enable_prefix_caching=True)
    run_prompt(pt, "a", range(13))
    run_prompt(pt, "b", range(10))
    run_prompt(pt, "c", range(10))  # b's full pages from the prefix cache
    pt.append_tokens("c", [1, 2])
    pt.allocate_slots("c", 2)
    for rid in "abc":
        pt.free(rid)
        pt.check_invariants()
    assert pt.pool.num_used_pages == 0 and pt.num_requests == 0
    assert pt.pool.num_free_pages + pt.pool.num_cached_pages == 19
    pt.pool.evict()
    assert pt.pool.num_free_pages == 19


@given(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14),
       query=st.lists(st.integers(0, 2), min_size=1, max_size=14), page_size=st.integers(1, 4))
@settings(max_examples=150, deadline=None)
def test_lookup_is_the_longest_common_prefix_of_full_pages(prompt, query, page_size):
    pt = PageTable(16, page_size, enable_prefix_caching=True)
    run_prompt(pt, "a", prompt)
    pt.free("a")
    common = 0
    while common < min(len(prompt), len(query) - 1) and prompt[common] == query[common]:
        common += 1
    assert pt.lookup_prefix(query) == common // page_size * page_size


# Sliding window: the pages behind a window every layer shares are given back.

def _decode(pt: PageTable, rid, tokens) -> None:
    for t in tokens:
        pt.append_tokens(rid, [t])
        assert pt.allocate_slots(rid, 1)
        pt.mark_computed(rid, 1)
        pt.check_invariants()


def test_pages_behind_the_window_are_given_back():
    pt = PageTable(12, 4, sliding_window=6)
    assert pt.allocate_prompt("a", list(range(9))) == 0
    pt.mark_computed("a", 7)  # the next query (position 7) reads keys 2..7: every page
    pt.check_invariants()
    assert NULL_PAGE not in pt.page_ids("a") and pt.num_window_released_pages == 0
    pt.mark_computed("a", 2)  # the next query (9) reads keys 4..9: not page 0 (keys 0..3)
    pt.check_invariants()
    assert pt.page_ids("a")[0] == NULL_PAGE and pt.num_window_released_pages == 1
    _decode(pt, "a", range(9, 15))  # the next query (15) reads keys 10..15: pages 2 and 3
    ids = pt.page_ids("a")
    assert len(ids) == 4 and ids[:2] == [NULL_PAGE] * 2 and NULL_PAGE not in ids[2:]
    assert pt.num_window_released_pages == 2 and pt.pool.num_used_pages == 2
    pt.free("a")
    pt.check_invariants()
    assert pt.pool.num_free_pages == 11


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 10), page_size=st.integers(1, 4),
       chunks=st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_exactly_the_pages_no_later_query_reads_are_given_back(window, page_size, chunks):
    """After each step, every page given back lies wholly before the window of the next query
    (keys k > q - window for a query at q >= num_computed), and the first page kept does not."""
    pt = PageTable(64, page_size, sliding_window=window)
    tokens = list(range(sum(chunks)))
    assert pt.allocate_prompt("a", tokens, num_new_tokens=chunks[0]) == 0
    done = 0
    for i, chunk in enumerate(chunks):
        if i:
            assert pt.allocate_slots("a", chunk)
        pt.mark_computed("a", chunk)
        done += chunk
        pt.check_invariants()
        ids = pt.page_ids("a")
        released = sum(p == NULL_PAGE for p in ids)
        assert ids[:released] == [NULL_PAGE] * released
        assert not released or released * page_size - 1 <= done - window  # the last key given back: out of reach
        if released < len(ids):
            assert (released + 1) * page_size - 1 > done - window  # the next page is still read
    pt.free("a")
    pt.check_invariants()
    assert pt.pool.num_free_pages == 63


def test_window_pages_given_back_stay_cached_for_a_prefix_hit():
    pt = PageTable(16, 2, enable_prefix_caching=True, sliding_window=3)
    prompt = list(range(11))
    # 11 computed: keys 0..8 out of reach, (11 - 3 + 1) // 2 = 4 pages given back, still cached
    run_prompt(pt, "a", prompt)
    assert pt.page_ids("a")[:4] == [NULL_PAGE] * 4 and pt.pool.num_cached_pages == 4
    assert pt.lookup_prefix(prompt) == 10  # every full page, the given-back ones too
    num_cached = pt.allocate_prompt("b", prompt)
    assert num_cached == 10
    assert pt.page_ids("b")[:4] == [NULL_PAGE] * 4  # a hit past the window gives them back at once
    pt.mark_computed("b", 1)
    pt.check_invariants()
    pt.free("a")
    pt.free("b")
    pt.check_invariants()
    assert pt.pool.num_used_pages == 0


def test_a_bad_window_is_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        PageTable(8, 4, sliding_window=0)

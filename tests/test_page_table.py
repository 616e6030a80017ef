"""jserve.page_table: a unit test per behaviour, then a hypothesis state machine over a fake device."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jserve.page_pool import NULL_PAGE, PagePool
from jserve.page_table import PageTable


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
                 lambda: pt.fork("x", "y"), lambda: pt.mark_computed("x", 1), lambda: pt.num_tokens("x"),
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
    with pytest.raises(ValueError, match="not yet computed"):
        pt.fork("a", "b")
    pt.mark_computed("a", 5)
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        pt.fork("a", "a")
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
    assert pt.allocate_slots("a", 3) == []
    assert len(pt.page_ids("a")) == 2
    pt.mark_computed("a", 6)
    pt.append_tokens("a", [7, 8, 9])
    assert pt.allocate_slots("a", 3) == []
    assert len(pt.page_ids("a")) == 3 and pt.num_computed_tokens("a") == 6
    assert pt.allocate_slots("a", 0) == []
    assert pt.pool.num_used_pages == 3
    pt.check_invariants()


def test_fork_shares_pages_and_counts_references():
    pt = PageTable(10, 4)
    run_prompt(pt, "p", range(6))
    pt.fork("p", "c")
    pt.check_invariants()
    assert pt.page_ids("c") == pt.page_ids("p")
    assert [pt.pool.refcount(page) for page in pt.page_ids("p")] == [2, 2]
    assert pt.num_computed_tokens("c") == 6 and pt.num_tokens("c") == 6
    pt.free("p")
    pt.check_invariants()
    assert [pt.pool.refcount(page) for page in pt.page_ids("c")] == [1, 1]
    assert pt.pool.num_used_pages == 2
    pt.free("c")
    pt.check_invariants()
    assert pt.pool.num_free_pages == 9


def test_copy_on_write_of_shared_partial_last_page():
    pt = PageTable(10, 4)
    run_prompt(pt, "p", range(6))  # pages [x, y], y holds 2 of 4 slots
    pt.fork("p", "c")
    first, last = pt.page_ids("p")
    pt.append_tokens("c", [100])
    assert pt.can_allocate_slots("c", 1)
    copies = pt.allocate_slots("c", 1)
    (src, dst), = copies
    assert src == last and dst not in (first, last, NULL_PAGE)
    assert pt.page_ids("c") == [first, dst] and pt.page_ids("p") == [first, last]
    assert pt.pool.refcount(first) == 2 and pt.pool.refcount(last) == 1 and pt.pool.refcount(dst) == 1
    pt.check_invariants()
    pt.append_tokens("p", [200])
    assert pt.allocate_slots("p", 1) == []  # the parent owns `last` alone now
    assert pt.page_ids("p") == [first, last]
    pt.check_invariants()


def test_no_copy_when_shared_last_page_is_full():
    pt = PageTable(10, 4)
    run_prompt(pt, "p", range(8))
    pt.fork("p", "c")
    pt.append_tokens("c", [1])
    assert pt.allocate_slots("c", 1) == []
    assert pt.page_ids("c")[:2] == pt.page_ids("p") and len(pt.page_ids("c")) == 3
    pt.check_invariants()


def test_copy_on_write_needs_a_page():
    pt = PageTable(3, 4)
    run_prompt(pt, "p", range(6))
    pt.fork("p", "c")
    pt.append_tokens("c", [1])
    assert not pt.can_allocate_slots("c", 1)
    before = snapshot(pt)
    assert pt.allocate_slots("c", 1) is None
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
    assert pt.allocate_slots("b", 12) is None
    assert snapshot(pt) == before
    assert pt.can_allocate_prompt(range(20), num_new_tokens=0)
    assert pt.allocate_prompt("c", range(20), num_new_tokens=0) == 8
    pt.check_invariants()


def test_freeing_everything_returns_every_page():
    pt = PageTable(20, 4, enable_prefix_caching=True)
    run_prompt(pt, "a", range(13))
    run_prompt(pt, "b", range(10))
    pt.fork("b", "c")
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


# Random sequences over a fake device whose K/V slots hold the token prefix they were computed from.

PREFIXES = [[], [0, 1, 2, 0], [0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 2, 2, 2, 2]]  # so prompts share prefixes


class PageTableMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.one_of(st.integers(2, 6), st.integers(7, 32)), page_size=st.integers(1, 4),
                caching=st.booleans())
    def setup(self, num_pages, page_size, caching):
        self.pt = PageTable(num_pages, page_size, enable_prefix_caching=caching)
        self.kv = [[None] * page_size for _ in range(num_pages)]  # [num_pages, page_size]
        self.salts = {}
        self.next_id = 0

    def pick(self, data):
        return data.draw(st.sampled_from(sorted(self.salts)))

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def try_allocate(self, rid, k) -> bool:
        fits = self.pt.can_allocate_slots(rid, k)
        before = snapshot(self.pt)
        copies = self.pt.allocate_slots(rid, k)
        assert fits == (copies is not None)
        if copies is None:
            assert snapshot(self.pt) == before
            return False
        for src, dst in copies:
            self.kv[dst] = list(self.kv[src])
        return True

    def compute(self, rid, k):
        """The device step: writes K/V for the next `k` allocated tokens, then marks them computed."""
        start = self.pt.num_computed_tokens(rid)
        tokens, pages, size = self.pt._seqs[rid].token_ids, self.pt.page_ids(rid), self.pt.page_size
        for pos in range(start, start + k):
            page = pages[pos // size]
            assert self.pt.pool.refcount(page) == 1, "a write reached a shared page"
            assert self.pt.pool.page_hash(page) is None, "a write reached a cached page"
            self.kv[page][pos % size] = tuple(tokens[:pos + 1])
        self.pt.mark_computed(rid, k)

    @rule(data=st.data(), prefix=st.sampled_from(PREFIXES),
          tail=st.lists(st.integers(0, 2), max_size=6), salt=st.sampled_from([None, "t"]))
    def admit(self, data, prefix, tail, salt):
        prompt = prefix + tail or [0]
        num_cached = self.pt.lookup_prefix(prompt, cache_salt=salt)
        assert num_cached % self.pt.page_size == 0 and num_cached < len(prompt)
        k = data.draw(st.one_of(st.just(len(prompt) - num_cached), st.integers(0, len(prompt) - num_cached)))
        fits = self.pt.can_allocate_prompt(prompt, num_new_tokens=k, cache_salt=salt)
        before = snapshot(self.pt)
        rid = self.new_id()
        result = self.pt.allocate_prompt(rid, prompt, num_new_tokens=k, cache_salt=salt)
        assert fits == (result is not None)
        if result is None:
            assert snapshot(self.pt) == before
        else:
            assert result == num_cached
            self.salts[rid] = salt

    @precondition(lambda self: self.salts)
    @rule(data=st.data())
    def allocate_some(self, data):
        rid = self.pick(data)
        num_unallocated = self.pt.num_tokens(rid) - self.pt.num_allocated_tokens(rid)
        self.try_allocate(rid, data.draw(st.integers(0, num_unallocated)))

    @precondition(lambda self: self.salts)
    @rule(data=st.data())
    def compute_some(self, data):
        rid = self.pick(data)
        num_pending = self.pt.num_allocated_tokens(rid) - self.pt.num_computed_tokens(rid)
        self.compute(rid, data.draw(st.integers(0, num_pending)))

    @precondition(lambda self: self.salts)
    @rule(data=st.data())
    def step(self, data):
        """Allocates and computes every known token of a request, as an unchunked scheduler would."""
        rid = self.pick(data)
        if self.try_allocate(rid, self.pt.num_tokens(rid) - self.pt.num_allocated_tokens(rid)):
            self.compute(rid, self.pt.num_allocated_tokens(rid) - self.pt.num_computed_tokens(rid))

    @precondition(lambda self: self.salts)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data, token):
        self.decode_one(self.pick(data), token)

    def decode_one(self, rid, token):
        if self.pt.num_computed_tokens(rid) == self.pt.num_tokens(rid):
            self.pt.append_tokens(rid, [token])
            if self.try_allocate(rid, 1):
                self.compute(rid, 1)

    @precondition(lambda self: self.salts)
    @rule(data=st.data())
    def preempt(self, data):
        """Frees a request and admits it again with all its tokens: the prefix cache saves recompute."""
        rid = self.pick(data)
        tokens, salt = list(self.pt._seqs[rid].token_ids), self.salts.pop(rid)
        self.pt.free(rid)
        self.pt.check_invariants()
        if self.pt.allocate_prompt(rid, tokens, cache_salt=salt) is not None:
            self.salts[rid] = salt

    @precondition(lambda self: self.salts)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def append(self, data, tokens):
        self.pt.append_tokens(self.pick(data), tokens)

    @precondition(lambda self: self.salts)
    @rule(data=st.data())
    def fork(self, data):
        parent, child = self.pick(data), self.new_id()
        if self.pt.num_computed_tokens(parent) != self.pt.num_allocated_tokens(parent):
            with pytest.raises(ValueError, match="not yet computed"):
                self.pt.fork(parent, child)
            return
        self.pt.fork(parent, child)
        self.salts[child] = self.salts[parent]
        if data.draw(st.booleans()):  # a parallel sample decodes at once: copy-on-write if partial
            self.decode_one(child, data.draw(st.integers(0, 2)))

    @precondition(lambda self: self.salts)
    @rule(data=st.data())
    def free(self, data):
        rid = self.pick(data)
        self.pt.free(rid)
        del self.salts[rid]

    @rule(num_pages=st.integers(0, 3))
    def evict(self, num_pages):
        num_cached = self.pt.pool.num_cached_pages
        assert self.pt.pool.evict(num_pages) == min(num_pages, num_cached)

    @invariant()
    def consistent(self):
        self.pt.check_invariants()
        pool, size = self.pt.pool, self.pt.page_size
        assert pool.num_free_pages + pool.num_cached_pages + pool.num_used_pages == pool.num_pages - 1
        salt_of_page = {}
        for rid, salt in self.salts.items():
            tokens, pages = self.pt._seqs[rid].token_ids, self.pt.page_ids(rid)
            for pos in range(self.pt.num_computed_tokens(rid)):
                assert self.kv[pages[pos // size]][pos % size] == tuple(tokens[:pos + 1]), (rid, pos)
            for page in pages:
                assert salt_of_page.setdefault(page, salt) == salt, f"page {page} crossed tenants"

    def teardown(self):
        for rid in list(self.salts):
            self.pt.free(rid)
            self.pt.check_invariants()
        pool = self.pt.pool
        assert pool.num_used_pages == 0
        assert pool.num_free_pages + pool.num_cached_pages == pool.num_pages - 1


PageTableMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_page_table_state_machine = PageTableMachine.TestCase

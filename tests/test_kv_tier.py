"""jserve.core.kv_tier: the host KV tier's page accounting (unit tests, and test_page_table_machine's
state machine over both tiers: a fake device and host whose slots hold the token prefix they
were computed from, copies completing in any step after they start)."""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from jserve.core.kv_tier import HostSlots, TieredPageTable
from test_page_table import run_prompt
from test_page_table_machine import PageTableMachine


def test_host_slots_lru_and_pins():
    host = HostSlots(2)
    a, b = host.reserve(b"a"), host.reserve(b"b")
    assert host.reserve(b"c") is None  # both writing
    assert host.holds(b"a") and host.lookup(b"a") is None  # not readable before the copy completes
    assert host.complete(a) and host.complete(b)
    assert host.lookup(b"a") == a
    host.read(a)  # a reload planned: not evictable, and most recently used
    c = host.reserve(b"c")
    assert c == b and host.lookup(b"b") is None and host.num_evicted == 1
    assert host.reserve(b"d") is None  # a is read, c writing
    host.read_done(a)
    host.check_invariants()
    host.reset()
    assert not host.complete(c)  # its copy went stale
    assert host.num_ready == 0
    host.check_invariants()


def _table(num_pages=5, host_slots=8, staging=4):
    return TieredPageTable(num_pages, 2, host_slots=host_slots, staging_pages=staging, enable_prefix_caching=True)


def test_idle_pages_are_copied_pinned_and_reloaded():
    pt = _table()
    run_prompt(pt, "a", [1, 2, 3, 4, 5])  # two full pages, a partial one
    pt.free("a")
    transfers = pt.take_transfers()
    assert [slot for _, slot in transfers.offloads] == [0, 1] and not transfers.reloads
    pinned = [page for page, _ in transfers.offloads]
    assert all(pt.pool.refcount(p) == 1 for p in pinned)  # pinned: never handed out while copied
    assert pt.pool.num_available_pages == 2  # the free pages only
    pt.check_invariants()
    assert pt.lookup_prefix([1, 2, 3, 4, 5]) == 4  # the device still holds them
    pt.offloads_done(transfers.offloads)
    assert pt.num_offloaded_pages == 2 and pt.pool.num_cached_pages == 2
    assert not pt.take_transfers()  # the host holds them already
    pt.pool.evict()  # the device cache forgets them
    assert pt.lookup_prefix([1, 2, 3, 4, 5]) == 4  # the host tier has them
    assert pt.allocate_prompt("b", [1, 2, 3, 4, 5]) == 4
    assert pt.num_computed_tokens("b") == 4 and pt.num_host_hit_tokens == 4 and pt.num_prefix_hit_tokens == 0
    transfers = pt.take_transfers()
    # The pages went idle tail first (a request frees its last page first), so slot 0 holds the second.
    assert [slot for slot, _ in transfers.reloads] == [1, 0]
    assert [page for _, page in transfers.reloads] == pt.page_ids("b")[:2]
    with pytest.raises(AssertionError):
        pt.host.reset()  # reloads planned and not staged
    pt.reloads_staged(transfers.reloads)
    pt.check_invariants()
    assert pt.lookup_prefix([1, 2, 3, 4, 9]) == 4  # the reloaded pages are the device's again


def test_staging_bounds_the_copies_in_flight():
    pt = _table(num_pages=9, staging=1)
    run_prompt(pt, "a", [1, 2, 3, 4, 5, 6, 7])
    pt.free("a")
    first = pt.take_transfers().offloads
    assert len(first) == 1 and not pt.take_transfers().offloads
    pt.offloads_done(first)
    assert len(pt.take_transfers().offloads) == 1


def test_reset_drops_the_host_tier():
    pt = _table()
    run_prompt(pt, "a", [1, 2, 3])
    pt.free("a")
    inflight = pt.take_transfers().offloads
    pt.reset_prefix_cache()
    pt.offloads_done(inflight)
    assert pt.host.num_ready == 0 and pt.num_offloaded_pages == 0
    assert pt.pool.num_free_pages == 4
    pt.check_invariants()


def test_needs_prefix_caching():
    with pytest.raises(ValueError, match="prefix caching"):
        TieredPageTable(4, 2, host_slots=2, staging_pages=1)


class TieredMachine(PageTableMachine):
    """The page-table machine over two tiers: copies out start after admissions and on their
    own, complete in order at any later rule; reloads land right after admission (before the
    step). A page written while pinned, or a copy of a reused page, breaks the machine's
    invariant that every computed slot holds its token prefix."""

    @initialize(num_pages=st.one_of(st.integers(2, 6), st.integers(7, 32)), page_size=st.integers(1, 4),
                host_slots=st.integers(1, 12), staging=st.integers(1, 4))
    def setup(self, num_pages, page_size, host_slots, staging):
        self.pt = TieredPageTable(num_pages, page_size, host_slots=host_slots, staging_pages=staging,
                                  enable_prefix_caching=True)
        self.kv = [[None] * page_size for _ in range(num_pages)]
        self.salts, self.next_id = {}, 0
        self.host, self.inflight, self.past = {}, [], []

    def admitted(self):
        self.transfer()

    @rule()
    def transfer(self):
        transfers = self.pt.take_transfers()
        for slot, page in transfers.reloads:
            self.kv[page] = list(self.host[slot])
        self.pt.reloads_staged(transfers.reloads)
        self.inflight += transfers.offloads

    @rule(n=st.integers(1, 4))
    def complete(self, n):
        done, self.inflight = self.inflight[:n], self.inflight[n:]
        for page, slot in done:  # the copy reads the page now: it must not have changed
            assert None not in self.kv[page], f"page {page} copied before it was full"
            self.host[slot] = list(self.kv[page])
        self.pt.offloads_done(done)

    @precondition(lambda self: self.salts)
    @rule(data=st.data())
    def finish(self, data):
        """Frees a request whose prompt a later `revisit` sends again."""
        rid = self.pick(data)
        self.past.append((list(self.pt._seqs[rid].token_ids), self.salts.pop(rid)))
        self.pt.free(rid)

    @precondition(lambda self: self.past)
    @rule(data=st.data())
    def revisit(self, data):
        prompt, salt = data.draw(st.sampled_from(self.past))
        num_cached = self.pt.lookup_prefix(prompt, cache_salt=salt)
        rid = self.new_id()
        if self.pt.allocate_prompt(rid, prompt, cache_salt=salt) is not None:
            assert self.pt.num_computed_tokens(rid) == num_cached
            self.salts[rid] = salt
            self.transfer()

    @rule()
    def spill(self):
        """Every copy completes, then the device's cache forgets all it can: later prefix hits
        come from the host tier."""
        for _ in range(self.pt.pool.num_pages):
            self.transfer()
            self.complete(len(self.inflight))
        self.pt.pool.evict()

    def compute(self, rid, k):
        pages, start, size = self.pt.page_ids(rid), self.pt.num_computed_tokens(rid), self.pt.page_size
        assert not {pages[p // size] for p in range(start, start + k)} & set(self.pt._offloading), "pinned page written"
        super().compute(rid, k)

    def teardown(self):
        self.complete(len(self.inflight))
        super().teardown()


TieredMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_tiered_page_table_state_machine = TieredMachine.TestCase

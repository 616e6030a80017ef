"""jserve.core.page_table under a hypothesis state machine: random admissions, growth, frees and
prefix hits over a fake device whose K/V slots hold the token prefix they were computed from.
The unit tests, one per behaviour, are in test_page_table.py."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jserve.core.page_table import PageTable
from test_page_table import snapshot

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
        allocated = self.pt.allocate_slots(rid, k)
        assert fits == allocated
        if not allocated:
            assert snapshot(self.pt) == before
        return allocated

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
            self.admitted()

    def admitted(self):
        """After an admission, before any step (a host tier's reloads land here)."""

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
            self.admitted()

    @precondition(lambda self: self.salts)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def append(self, data, tokens):
        self.pt.append_tokens(self.pick(data), tokens)

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

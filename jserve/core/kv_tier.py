"""The host KV tier's bookkeeping: full prefix pages copied from the device to host slots, and
copied back on a later prefix hit instead of being recomputed. Pure Python; the copies are
`jserve.runtime.kv_transfer`'s.

`HostSlots` is the host tier: slots indexed by the same chained, tenant-salted page hashes as
the device's prefix cache, each slot free, *writing* (a copy from the device in flight),
*ready* (indexed, evicted least recently used first) or ready and *read* (a reload planned
and not yet staged, so not evictable). `TieredPageTable` is a `PageTable` over both tiers: a
page that goes idle in the device's prefix cache is queued for a copy, which pins the page (one
more owner) until the copy completes, so a page being copied is never handed out; admission
takes a prefix's pages from the device cache, then from the host tier (reloads into fresh
device pages, which count as computed). See docs/architecture.md ("The host KV tier").
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Sequence

from jserve.core.page_pool import iter_page_hashes
from jserve.core.page_table import PageTable, _as_token_ids


class HostSlots:
    """Host slots by page hash: free, writing, ready (LRU), read (ready, pinned by reloads)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one page slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = collections.deque(range(num_slots))
        self._ready: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # LRU first
        self._slot_by_hash: dict[bytes, int] = {}  # ready slots only
        self._writing: dict[int, bytes | None] = {}  # None: its copy went stale (reset) meanwhile
        self._reading: collections.Counter[int] = collections.Counter()
        self.num_evicted = 0

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def num_writing(self) -> int:
        return len(self._writing)

    def lookup(self, page_hash: bytes) -> int | None:
        """The ready slot holding this page hash, if any."""
        return self._slot_by_hash.get(page_hash)

    def holds(self, page_hash: bytes) -> bool:
        """Whether the hash is ready here or being written."""
        return page_hash in self._slot_by_hash or page_hash in self._writing.values()

    def reserve(self, page_hash: bytes) -> int | None:
        """A slot to write this hash into: a free one, else the least recently used ready one
        that no reload reads; None if every slot is writing or read."""
        if self._free:
            slot = self._free.popleft()
        else:
            slot = next((s for s in self._ready if not self._reading[s]), None)
            if slot is None:
                return None
            del self._slot_by_hash[self._ready.pop(slot)]
            self.num_evicted += 1
        self._writing[slot] = page_hash
        return slot

    def complete(self, slot: int) -> bool:
        """The copy into `slot` completed: it is ready (False: it went stale, and is free)."""
        page_hash = self._writing.pop(slot)
        if page_hash is None or page_hash in self._slot_by_hash:
            self._free.append(slot)
            return False
        self._ready[slot] = page_hash
        self._slot_by_hash[page_hash] = slot
        return True

    def read(self, slot: int) -> None:
        """A reload of `slot` is planned: most recently used, and pinned until `read_done`."""
        self._ready.move_to_end(slot)
        self._reading[slot] += 1

    def read_done(self, slot: int) -> None:
        assert self._reading[slot] > 0, f"host slot {slot} was not being read"
        self._reading[slot] -= 1
        if not self._reading[slot]:
            del self._reading[slot]

    def touch(self, page_hash: bytes) -> None:
        slot = self._slot_by_hash.get(page_hash)
        if slot is not None:
            self._ready.move_to_end(slot)

    def reset(self) -> None:
        """Forget every page (new weights): ready slots freed, copies in flight stale."""
        assert not self._reading, "reset while reloads are planned"
        self._free.extend(self._ready)
        self._ready.clear()
        self._slot_by_hash.clear()
        self._writing = dict.fromkeys(self._writing)

    def check_invariants(self) -> None:
        free, ready, writing = set(self._free), set(self._ready), set(self._writing)
        assert len(free) == len(self._free), "a host slot is twice on the free list"
        assert not (free & ready or free & writing or ready & writing), "a host slot in two states"
        assert free | ready | writing == set(range(self.num_slots)), "a host slot lost"
        assert set(self._reading) <= ready, "a reload reads a slot that is not ready"
        assert {s: h for h, s in self._slot_by_hash.items()} == dict(self._ready), "host index disagrees"


@dataclasses.dataclass
class PageTransfers:
    """One step's copies between the tiers: `offloads` (device page, host slot) to start, and
    `reloads` (host slot, device page) to apply before the step runs."""

    offloads: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    reloads: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.reloads)


class TieredPageTable(PageTable):
    """A `PageTable` whose prefix cache has a host tier (`HostSlots`) behind the device's.

    Per step: `schedule()` admits (reloads planned into fresh pages), then `take_transfers()`
    says which idle cached pages to copy out (at most `staging_pages` in flight) and which
    reloads to apply; `reloads_staged` after the runner read the host slots; `offloads_done`
    after copies completed (pages unpinned, slots ready).
    """

    def __init__(self, num_pages: int, page_size: int = 16, *, host_slots: int, staging_pages: int, **kwargs):
        super().__init__(num_pages, page_size, **kwargs)
        if not self.enable_prefix_caching:
            raise ValueError("the host KV tier holds prefix-cache pages: it needs prefix caching")
        if staging_pages < 1:
            raise ValueError(f"staging_pages must be >= 1, got {staging_pages}")
        self.host = HostSlots(host_slots)
        self.staging_pages = staging_pages
        self._idle: collections.deque[int] = collections.deque(maxlen=num_pages)  # idle since, oldest first
        self.pool.on_cached = self._idle.append
        self._offloading: dict[int, int] = {}  # device page -> host slot, copy in flight
        self._reloads: list[tuple[int, int]] = []  # (host slot, device page) planned this step
        self.num_offloaded_pages = 0
        self.num_reloaded_pages = 0
        self.num_host_hit_tokens = 0

    # Admission: the device's cached prefix, then the host's.

    def _host_hits(self, token_ids: list[int], cache_salt: str | None) -> tuple[int, list[int]]:
        """(device hit pages, host slots of the pages after them held by the host tier)."""
        num_device = super().lookup_prefix(token_ids, cache_salt=cache_salt) // self.page_size
        slots = []
        if not self.host.num_ready:
            return num_device, slots
        for i, page_hash in enumerate(iter_page_hashes(token_ids[:-1], self.page_size, cache_salt)):
            if i < num_device:
                continue
            slot = self.host.lookup(page_hash)
            if slot is None:
                break
            slots.append(slot)
        return num_device, slots

    def lookup_prefix(self, token_ids: Sequence[int], *, cache_salt: str | None = None) -> int:
        """Leading tokens cached on the device or the host tier (whole pages, never the last token)."""
        num_device, slots = self._host_hits(_as_token_ids(token_ids), cache_salt)
        return (num_device + len(slots)) * self.page_size

    def _split(self, token_ids, num_new_tokens, cache_salt):
        token_ids = _as_token_ids(token_ids)
        num_device, slots = self._host_hits(token_ids, cache_salt)
        num_reload = len(slots) * self.page_size
        if num_new_tokens is None:
            num_new_tokens = len(token_ids) - num_device * self.page_size - num_reload
        elif not 0 <= num_new_tokens <= len(token_ids) - num_device * self.page_size - num_reload:
            raise ValueError(f"num_new_tokens={num_new_tokens} outside [0, {len(token_ids) - num_reload}]: "
                             f"{len(token_ids)} prompt tokens, {num_device * self.page_size + num_reload} cached")
        return token_ids, num_device, slots, num_reload + num_new_tokens

    def can_allocate_prompt(self, token_ids: Sequence[int], *, num_new_tokens: int | None = None,
                            cache_salt: str | None = None) -> bool:
        token_ids, _, _, num_fresh_tokens = self._split(token_ids, num_new_tokens, cache_salt)
        return super().can_allocate_prompt(token_ids, num_new_tokens=num_fresh_tokens, cache_salt=cache_salt)

    def allocate_prompt(self, request_id: Hashable, token_ids: Sequence[int], *,
                        num_new_tokens: int | None = None, cache_salt: str | None = None) -> int | None:
        """`PageTable.allocate_prompt`, the host tier's pages of the prefix reloaded into fresh
        pages (computed from now on; the step's transfers fill them before it runs)."""
        token_ids, num_device, slots, num_fresh_tokens = self._split(token_ids, num_new_tokens, cache_salt)
        hit = super().allocate_prompt(request_id, token_ids, num_new_tokens=num_fresh_tokens, cache_salt=cache_salt)
        if hit is None or not slots:
            return hit
        pages = self._seqs[request_id].page_ids[num_device:num_device + len(slots)]
        self.mark_computed(request_id, len(slots) * self.page_size)
        for slot, page in zip(slots, pages):
            self.host.read(slot)
            self._reloads.append((slot, page))
        self.num_host_hit_tokens += len(slots) * self.page_size
        return hit + len(slots) * self.page_size

    # The step's copies.

    def take_transfers(self) -> PageTransfers:
        """This step's copies: the reloads admission planned, and copies out of the pages idle
        longest that the host tier lacks, while fewer than `staging_pages` are in flight."""
        offloads = []
        while self._idle and len(self._offloading) < self.staging_pages:
            page = self._idle.popleft()
            page_hash = self.pool.page_hash(page)
            if page_hash is None or self.pool.refcount(page) or page in self._offloading:
                continue  # in use again (it is queued anew when idle), or no longer cached
            if self.host.holds(page_hash):
                self.host.touch(page_hash)
                continue
            slot = self.host.reserve(page_hash)
            if slot is None:
                self._idle.appendleft(page)
                break  # every host slot is being written or read: retry next step
            self.pool.share(page)  # pinned until the copy completes: never handed out meanwhile
            self._offloading[page] = slot
            offloads.append((page, slot))
        reloads, self._reloads = self._reloads, []
        return PageTransfers(offloads, reloads)

    def reloads_staged(self, reloads: Sequence[tuple[int, int]]) -> None:
        """The runner read these host slots: they may be overwritten from now on."""
        for slot, _ in reloads:
            self.host.read_done(slot)
        self.num_reloaded_pages += len(reloads)

    def offloads_done(self, offloads: Sequence[tuple[int, int]]) -> None:
        """These copies to the host completed: the slots are ready and the pages unpinned."""
        for page, slot in offloads:
            assert self._offloading.pop(page) == slot, (page, slot)
            self.num_offloaded_pages += self.host.complete(slot)
            self.pool.release([page])

    @property
    def num_offloading(self) -> int:
        return len(self._offloading)

    def reset_prefix_cache(self) -> int:
        self.host.reset()
        return super().reset_prefix_cache()

    def check_invariants(self) -> None:
        """`PageTable.check_invariants`, counting the pins of copies in flight as owners."""
        super().check_invariants(collections.Counter(list(self._offloading)))
        self.host.check_invariants()
        assert set(self._offloading.values()) <= set(self.host._writing), "a copy writes a slot not reserved"

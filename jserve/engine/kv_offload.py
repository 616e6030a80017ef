"""The engine's side of the host KV tier: each dp group's `TieredPageTable` (the accounting,
`jserve.core.kv_tier`) and the runner's `KVTransfer` (the copies), driven once per step between
the schedule and the execute phase; a no-op without `kv_offload_bytes`."""

from __future__ import annotations

import collections
from typing import Any

from jserve.core.hybrid_pages import HybridPageTable
from jserve.core.kv_tier import TieredPageTable
from jserve.core.page_table import PageTable


def page_tables(runner: Any, sliding_window: int | None, enable_prefix_caching: bool) -> list[PageTable]:
    """A page table per dp group: over both tiers where the runner has a host tier; with hybrid
    pages (`Runner.local_pages`), a `HybridPageTable` (which has no host tier)."""
    kwargs = dict(sliding_window=sliding_window, enable_prefix_caching=enable_prefix_caching)
    transfer = runner.kv_transfer
    if getattr(runner, "hybrid", False):
        if transfer is not None:
            raise ValueError("the host KV tier (--kv-offload-bytes) does not take hybrid pages yet: the build "
                             "turns hybrid pages off for it")
        return [HybridPageTable(runner.pages_per_group, runner.local_pages_per_group, runner.page_size,
                                sliding_window=runner.config.sliding_window,
                                enable_prefix_caching=enable_prefix_caching) for _ in range(runner.dp)]
    if transfer is None:
        return [PageTable(runner.pages_per_group, runner.page_size, **kwargs) for _ in range(runner.dp)]
    return [TieredPageTable(runner.pages_per_group, runner.page_size, host_slots=transfer.slots_per_group,
                            staging_pages=transfer.staging_pages, **kwargs) for _ in range(runner.dp)]


class KVOffload:
    """Applies each step's copies between the tiers and takes back the completed ones."""

    def __init__(self, runner: Any, page_tables: list[PageTable]):
        self.runner = runner
        self.transfer = runner.kv_transfer
        self.tables = page_tables if self.transfer is not None else []

    def apply(self) -> None:
        """After `schedule()`, before the step: the planned reloads (their pages are read by the
        step), copies out of the pages gone idle, and the completed copies taken back (their
        pages unpinned, their slots readable from the next schedule on)."""
        if not self.tables:
            return
        per_group = [t.take_transfers() for t in self.tables]
        reloads = [(g, slot, page) for g, t in enumerate(per_group) for slot, page in t.reloads]
        if reloads:
            self.transfer.reload(reloads)
            for table, t in zip(self.tables, per_group):
                table.reloads_staged(t.reloads)
        self.transfer.offload([(g, page, slot) for g, t in enumerate(per_group) for page, slot in t.offloads])
        self._done(self.transfer.poll())

    def drain(self) -> None:
        """Wait for every copy in flight (the engine is idle): all pages unpinned."""
        if self.tables and self.transfer.in_flight:
            self._done(self.transfer.poll(wait=True))

    def _done(self, entries) -> None:
        by_group = collections.defaultdict(list)
        for g, page, slot in entries:
            by_group[g].append((page, slot))
        for g, done in by_group.items():
            self.tables[g].offloads_done(done)

    def stats(self) -> dict[str, Any]:
        """The host tier's counters (`jserve_kv_offload_*` in /metrics); {} without one."""
        if not self.tables:
            return {}
        totals = self.transfer.totals
        out_s, back_s = totals["offload_seconds"], totals["reload_seconds"]
        return {
            "kv_offload_pages_offloaded": sum(t.num_offloaded_pages for t in self.tables),
            "kv_offload_pages_reloaded": sum(t.num_reloaded_pages for t in self.tables),
            "kv_offload_host_hit_tokens": sum(t.num_host_hit_tokens for t in self.tables),
            "kv_offload_host_pages": sum(t.host.num_ready for t in self.tables),
            "kv_offload_host_slots": sum(t.host.num_slots for t in self.tables),
            "kv_offload_pages_in_flight": sum(t.num_offloading for t in self.tables),
            "kv_offload_bytes_offloaded": totals["offload_bytes"],
            "kv_offload_bytes_reloaded": totals["reload_bytes"],
            "kv_offload_seconds": out_s,
            "kv_reload_seconds": back_s,  # started to seen done (polled once a step: an upper bound)
            "kv_reload_host_seconds": totals["reload_host_seconds"],  # the host's part: staging, dispatch
            "kv_offload_bytes_per_second": totals["offload_bytes"] / out_s if out_s else 0.0,
            "kv_reload_bytes_per_second": totals["reload_bytes"] / back_s if back_s else 0.0,
            "kv_reload_prefill_seconds_saved": self._prefill_seconds_per_token() * sum(
                t.num_host_hit_tokens for t in self.tables),
        }

    def _prefill_seconds_per_token(self) -> float:
        """A mixed call's seconds per token computed, over the recent calls: what a reloaded
        token would have cost to recompute (an estimate beside `kv_reload_seconds`)."""
        mixed = [r for r in self.runner.step_log.records if r.kind == "mixed"]
        tokens = sum(r.real_tokens for r in mixed)
        return sum(r.seconds for r in mixed) / tokens if tokens else 0.0

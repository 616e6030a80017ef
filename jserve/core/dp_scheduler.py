"""Data-parallel scheduling: one scheduler and one page pool per `dp` group, one plan per step.

Each data-parallel group of devices holds its own share of the KV pages (the page axis is split
over `dp`), so a request lives in exactly one group for its whole life: its pages come from that
group's `PageTable` and its rows sit in that group's block of every batch. A new request goes to
the group that already caches the longest prefix of its prompt (prefix caching keeps working),
else to the least loaded one. Each group schedules its own token budget and sequence cap; the
step runs all groups' chunks in one call. Pure Python, like `scheduler.py`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from jserve.core.plan import Request, RequestStatus, ScheduledChunk, StepPlan
from jserve.core.scheduler import Scheduler
from jserve.core.stop import Stop


class DataParallelScheduler:
    """Routes requests to per-group `Scheduler`s and merges their plans (`SchedulerProtocol`)."""

    def __init__(self, schedulers: Sequence[Scheduler]):
        if not schedulers:
            raise ValueError("need at least one group scheduler")
        self.schedulers = list(schedulers)
        self._group: dict[str, int] = {}

    @property
    def page_tables(self):
        return [s.page_table for s in self.schedulers]

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.schedulers)

    @property
    def num_recomputes(self) -> int:
        return sum(s.num_recomputes for s in self.schedulers)

    @property
    def num_grammar_errors(self) -> int:
        return sum(s.num_grammar_errors for s in self.schedulers)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(r for s in self.schedulers for r in s.waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(r for s in self.schedulers for r in s.running)

    def group_of(self, request_id: str) -> int | None:
        return self._group.get(request_id)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, if any (the async engine reads its timings)."""
        g = self._group.get(request_id)
        return None if g is None else self.schedulers[g].get_request(request_id)

    def add_request(self, request: Request) -> None:
        if request.request_id in self._group:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        g = self._route(request)
        self.schedulers[g].add_request(request)
        self._group[request.request_id] = g

    def _route(self, request: Request) -> int:
        def key(g: int):
            s = self.schedulers[g]
            hit = s.page_table.lookup_prefix(request.prompt_token_ids, cache_salt=request.prefix_salt) \
                if s.page_table.enable_prefix_caching else 0
            return (-hit, s.num_running + s.num_waiting, g)

        return min(range(len(self.schedulers)), key=key)

    def abort_request(self, request_id: str) -> Request | None:
        g = self._group.pop(request_id, None)
        return None if g is None else self.schedulers[g].abort_request(request_id)

    def finish_request(self, request_id: str, status: RequestStatus, stop: Stop | None = None) -> None:
        g = self._group.pop(request_id, None)
        if g is not None:
            self.schedulers[g].finish_request(request_id, status, stop)

    def schedule(self) -> StepPlan:
        """The groups' plans side by side: group g's chunks, then group g + 1's (`plan.dp_groups`)."""
        plans = [s.schedule() for s in self.schedulers]
        return StepPlan(chunks=[c for p in plans for c in p.chunks], preempted=[r for p in plans for r in p.preempted],
                        num_batched_tokens=sum(p.num_batched_tokens for p in plans),
                        dp_groups=[g for g, p in enumerate(plans) for _ in p.chunks])

    def next_decode_step(self, chunk: ScheduledChunk) -> ScheduledChunk | None:
        """The group's `Scheduler.next_decode_step` (the runner runs multi-step decode for one
        group only, so the group schedulers plan single steps when dp > 1)."""
        g = self._group.get(chunk.request.request_id)
        return None if g is None else self.schedulers[g].next_decode_step(chunk)

    def reserve_drafts(self, chunk: ScheduledChunk, num_drafts: int) -> bool:
        g = self._group.get(chunk.request.request_id)
        return g is not None and self.schedulers[g].reserve_drafts(chunk, num_drafts)

    def release_lookahead(self, request_id: str) -> int:
        g = self._group.get(request_id)
        return 0 if g is None else self.schedulers[g].release_lookahead(request_id)

    def fill_placeholder(self, request: Request, index: int, token: int) -> None:
        """The request's group's `Scheduler.fill_placeholder` (a finished request, no longer in a
        group, gets its output's value only)."""
        g = self._group.get(request.request_id)
        self.schedulers[0 if g is None else g].fill_placeholder(request, index, token)
        if request.is_finished:
            self._group.pop(request.request_id, None)

    def update(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[Request]:
        changed = []
        for g, s in enumerate(self.schedulers):
            chunks = [c for c, group in zip(plan.chunks, plan.dp_groups) if group == g]
            part = StepPlan(chunks=chunks, preempted=[], num_batched_tokens=sum(c.num_tokens for c in chunks))
            for request in s.update(part, sampled):
                changed.append(request)
                if request.is_finished:
                    self._group.pop(request.request_id, None)
        return changed

    def check_invariants(self) -> None:
        for s in self.schedulers:
            s.check_invariants()
        live = {r.request_id for s in self.schedulers for r in s.waiting + s.running}
        assert live <= set(self._group), live - set(self._group)

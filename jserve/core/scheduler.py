"""Iteration-level scheduling: token budget, chunked prefill, prefix reuse and preemption (pure Python).

As in vLLM v1 there is no prefill phase: each request's computed-token count catches up with its
token count (prompt + sampled) out of a per-step token budget. `schedule()` serves running requests
first, then admits waiting ones, and returns a plain `StepPlan`; the engine runs it on the device
and hands the sampled tokens to `update()`. The engine decides stops (it detokenizes) and calls
`finish_request`; the scheduler only ends a request itself when it reaches the model length.

Orders. Waiting requests are admitted by (priority, arrival_time, arrival order): lower priority
values first (vLLM's convention), first come first served among equals, and admission stops at the
first that does not fit (no skipping, so a big request is not starved). Running requests are
served by (priority, admission order); the victim of a preemption is the last of that order, which
for equal priorities is the most recently admitted (a request may preempt itself if it is last).
Priority never preempts at admission: a high-priority arrival waits for pages like anyone else, but
once running it is served first and takes pages from lower-priority requests when short.

Budget. Each running request takes min(its uncomputed tokens, budget) but leaves one token for every
running request after it (`max_num_batched_tokens >= max_num_seqs` guarantees there is one), so a
long prompt is split into chunks and no running decode ever waits a step for it.

Preemption is by recompute: the victim's pages are freed (its full computed pages stay in the prefix
cache if enabled), its computed count goes back to 0 and it is requeued by its arrival key, which
for equal priorities puts it at the front. Re-admitted, it computes prompt + output so far as its
prompt; the chunk that reaches its last known token samples its next token, so no token is lost or
duplicated. A step that preempts admits nobody.

Capacity. A request never holds more than `max_len = min(max_model_len, pool tokens + 1)` tokens:
`add_request` rejects a prompt of `max_len` tokens or more with a ValueError (a prompt that can
never fit in the pool would otherwise preempt itself forever), and `update()` finishes a request
with FINISHED_LENGTH when it reaches `max_len`, since its last token could never be computed.

Multi-step decode (`num_scheduler_steps` = K > 1). When every running request is decoding (one
uncomputed token) and no waiting request could be admitted now (none waits, or every seat is
taken), `schedule()` plans up to K decode steps per request for one device call: each chunk's
`num_steps` is min(K, tokens left to `max_tokens`, room left to `max_len`), or, while a request
waits for a seat, the smallest of those over the running requests (the call ends when the first
seat frees, and the waiting request is admitted then). The pages for those steps are taken at
once (lookahead, see `PageTable.allocate_slots`); if they do not all fit without preempting, a
single step is planned instead. The engine then hands the device's tokens back one step at a
time: `next_decode_step(chunk)` gives the chunk of step j > 0, `update()` takes its token as
usual. A request that stops inside the call ends there; the device's later tokens for it are
dropped and its lookahead pages go back with the rest. The price is the usual one of multi-step
scheduling: a seat freed inside the call by a stop (EOS, a stop id or string) stays empty until
the call ends, so a waiting request may be admitted up to K - 1 steps later than with single
steps, and the stopped request's row computes for nothing until then.
While a request with structured outputs runs, every step is a single step: its grammar's mask for
the next token needs the token before it on the host.

Recompute past a length (`recompute_past` = n, a LongRoPE model's original context: it rotates every
position of a sequence of more than n tokens by other factors than a shorter one's). A request whose
token count passes n by a sample (from n to n + 1) is recomputed from its first token, as a
preemption would, but not counted as one (`num_recomputes`): Hugging Face's generate() drops its
cache there too. Its prefix-cache salt has two sides, at most n tokens and more, so no page computed
on one side is shared with the other; a multi-step decode (and a speculative step's drafts, see
`tokens_before_recompute`) never runs across n, the call's last sample at most reaches n + 1.

Speculative decoding takes its draft tokens' pages the same way, after `schedule()` (the engine
proposes drafts for the plan's decode chunks and calls `reserve_drafts`); the step's confirmed
drafts are then taken like a multi-step decode's tokens, and `release_lookahead` gives back the
rest of the pages.

Aborts free pages at once, even between `schedule()` and `update()`: the in-flight step may still
write K/V into those pages, but the pages were neither indexed by the prefix cache (only full,
computed pages are) nor can they be handed out before the next `schedule()`, whose step runs after
it. `update()` ignores chunks of requests that ended meanwhile.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import operator
import time
from collections.abc import Callable, Mapping

from jserve.core.page_table import PageTable

# The plan's types are this module's vocabulary too (and importable from here).
from jserve.core.plan import Request, RequestStatus, ScheduledChunk, SchedulerProtocol, StepPlan
from jserve.core.stop import tokens_left

__all__ = ["Request", "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerConfig",
           "SchedulerProtocol", "StepPlan"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # running sequences cap
    max_num_batched_tokens: int = 512  # tokens computed per step (decode tokens + prefill chunks)
    max_model_len: int = 2048  # prompt + output tokens of one request
    enable_prefix_caching: bool = False
    num_scheduler_steps: int = 1  # decode steps per device call when only decodes run (vLLM's name)
    recompute_past: int | None = None  # see the module's notes (None: never)

    def __post_init__(self):
        for name, minimum in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("max_model_len", 2),
                              ("num_scheduler_steps", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_num_seqs={self.max_num_seqs} (every running sequence takes a "
                             "token each step)")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.recompute_past is not None and (not isinstance(self.recompute_past, int)
                                                or isinstance(self.recompute_past, bool) or self.recompute_past < 1):
            raise ValueError(f"recompute_past must be a positive integer or None, got {self.recompute_past!r}")


def tokens_before_recompute(num_tokens: int, recompute_past: int | None) -> int | None:
    """The most tokens a request of `num_tokens` tokens may sample in one device call so that it
    computes no position past `recompute_past` (its last sample may take it to recompute_past + 1,
    and the recompute follows the call); None: no limit."""
    if recompute_past is None or num_tokens > recompute_past:
        return None
    return recompute_past + 1 - num_tokens


class Scheduler:
    """Turns waiting and running requests into one `StepPlan` per step over a `PageTable`."""

    def __init__(self, config: SchedulerConfig, page_table: PageTable,
                 clock: Callable[[], float] = time.monotonic):
        if config.enable_prefix_caching != page_table.enable_prefix_caching:
            raise ValueError(f"config.enable_prefix_caching={config.enable_prefix_caching} but "
                             f"page_table.enable_prefix_caching={page_table.enable_prefix_caching}")
        self.config = config
        self.page_table = page_table
        self.clock = clock
        pool_tokens = (page_table.pool.num_pages - 1) * page_table.page_size
        self.max_len = min(config.max_model_len, pool_tokens + 1)
        self.num_preemptions = 0
        self.num_recomputes = 0  # requests recomputed as they passed `recompute_past`
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: list[Request] = []  # sorted by _arrival_key
        self._running: list[Request] = []  # sorted by _admission_key
        self._arrival_key: dict[Request, tuple] = {}
        self._admission_key: dict[Request, tuple] = {}
        self._counter = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        """Waiting requests in admission order."""
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        """Running requests in service order."""
        return tuple(self._running)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, if any."""
        return self._requests.get(request_id)

    # Requests in and out.

    def add_request(self, request: Request) -> None:
        """Queues a new request. Raises ValueError for a duplicate id or a prompt that cannot fit."""
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r}: prompt_token_ids is empty")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} is {request.status.name}, not a new request")
        if request.num_tokens >= self.max_len:
            pool = self.page_table.pool
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_tokens} tokens leaves no room "
                f"for output: max_model_len={self.config.max_model_len}, the page pool holds "
                f"{(pool.num_pages - 1) * pool.page_size} tokens")
        self._requests[request.request_id] = request
        self._arrival_key[request] = (request.priority, request.arrival_time, next(self._counter))
        bisect.insort(self._waiting, request, key=self._arrival_key.__getitem__)

    def abort_request(self, request_id: str) -> Request | None:
        """Ends a waiting or running request now, freeing its pages; None if unknown or finished."""
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Ends a request with a stop the engine found; a no-op if it already finished."""
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status}")
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        del self._requests[request.request_id]
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            del self._admission_key[request]
            self.page_table.free(request.request_id)
        else:
            self._waiting.remove(request)
        del self._arrival_key[request]
        request.status = status
        request.finished_time = self.clock()

    # The step.

    def schedule(self) -> StepPlan:
        """Plans one step: chunks for running requests, then for newly admitted ones (or several
        decode steps, see the module's notes on multi-step decode)."""
        if self.config.num_scheduler_steps > 1:
            plan = self._schedule_decode_steps()
            if plan is not None:
                return plan
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self._running):
            request = self._running[i]
            # Leave one token for each running request after this one.
            num_reserved = len(self._running) - i - 1
            num_new = min(request.num_tokens - request.num_computed_tokens, budget - num_reserved)
            assert num_new > 0, (request.request_id, num_new, budget, num_reserved)
            while not (allocated := self.page_table.allocate_slots(request.request_id, num_new)):
                victim = self._running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if not allocated:
                break  # the request preempted itself; it was the last one
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
            i += 1

        if not preempted:
            budget = self._admit(budget, chunks)
        return StepPlan(chunks=chunks, preempted=preempted,
                        num_batched_tokens=self.config.max_num_batched_tokens - budget)

    def _schedule_decode_steps(self) -> StepPlan | None:
        """A multi-step decode plan, or None where a single step must run (see the module doc)."""
        running = self._running
        if not running or (self._waiting and len(running) < self.config.max_num_seqs):
            return None
        if any(r.num_tokens - r.num_computed_tokens != 1 for r in running):
            return None  # a prompt (or a preempted request's recompute) is still in chunks
        if any(r.params.structured_outputs is not None for r in running):
            return None  # a grammar's mask needs each sample on the host: single steps while one runs
        steps = [self._num_decode_steps(r) for r in running]
        if self._waiting:
            # Someone waits for a seat: end the call when the first seat frees by max_tokens or
            # max_len, rather than leave it empty for the rest of the call.
            steps = [min(steps)] * len(steps)
            if steps[0] == 1:
                return None
        table = self.page_table
        need = sum(table.num_fresh_pages(r.request_id, 1, num_lookahead=n - 1) for r, n in zip(running, steps))
        if need > table.pool.num_available_pages:
            return None  # the single step preempts as it must
        chunks = []
        for request, n in zip(running, steps):
            allocated = table.allocate_slots(request.request_id, 1, num_lookahead=n - 1)
            assert allocated, "counted above"
            chunk = self._chunk(request, 1)
            chunk.num_steps = n
            chunks.append(chunk)
        return StepPlan(chunks=chunks, preempted=[], num_batched_tokens=len(chunks))

    def _num_decode_steps(self, request: Request) -> int:
        """Steps a multi-step decode may run for `request`: K, fewer near max_tokens or max_len."""
        left = tokens_left(request.params, len(request.output_token_ids), request.num_tokens, self.max_len)
        before = tokens_before_recompute(request.num_tokens, self.config.recompute_past)
        return max(min(self.config.num_scheduler_steps, left, before or left), 1)

    def next_decode_step(self, chunk: ScheduledChunk) -> ScheduledChunk | None:
        """The chunk of a multi-step decode's next step for `chunk`'s request: its newest token, in
        a slot its lookahead pages hold. None if the request ended meanwhile."""
        request = chunk.request
        if self._requests.get(request.request_id) is not request:
            return None
        assert self.page_table.num_fresh_pages(request.request_id, 1) == 0, \
            "the lookahead pages hold every step of a multi-step decode"
        self.page_table.allocate_slots(request.request_id, 1)
        return self._chunk(request, 1)

    def reserve_drafts(self, chunk: ScheduledChunk, num_drafts: int) -> bool:
        """Speculative decoding: pages for `num_drafts` tokens after a decode chunk's own (lookahead,
        as for multi-step decode), before the step runs; False (nothing taken) when the pool is short,
        and the step then runs without drafts (speculation never preempts). The chunk's `page_ids`
        are updated. The step's confirmed drafts then go through `next_decode_step` and `update`
        one at a time, and `release_lookahead` returns the pages of the rejected ones."""
        request = chunk.request
        if chunk.num_tokens != 1 or not chunk.samples:
            raise ValueError("drafts follow a decode chunk (one token, sampled)")
        if num_drafts <= 0:
            return num_drafts == 0
        if not self.page_table.allocate_slots(request.request_id, 0, num_lookahead=num_drafts):
            return False
        chunk.page_ids = self.page_table.page_ids(request.request_id)
        return True

    def release_lookahead(self, request_id: str) -> int:
        """The running request's pages past its known tokens go back to the pool (see
        `PageTable.release_lookahead`); 0 for a request that ended."""
        request = self._requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return 0
        return self.page_table.release_lookahead(request_id)

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Admits waiting requests in order while seats, budget and pages allow; returns the budget left."""
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            # After a preemption the prompt to compute is prompt + output so far.
            token_ids = request.all_token_ids
            salt = self._cache_salt(request)
            num_cached = self.page_table.lookup_prefix(token_ids, cache_salt=salt)
            num_new = min(len(token_ids) - num_cached, budget)
            hit = self.page_table.allocate_prompt(request.request_id, token_ids, num_new_tokens=num_new,
                                                  cache_salt=salt)
            if hit is None:
                break  # no skipping: the head waits for pages
            assert hit == num_cached, (hit, num_cached)
            self._waiting.pop(0)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.clock()
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            self._admission_key[request] = (request.priority, next(self._counter))
            bisect.insort(self._running, request, key=self._admission_key.__getitem__)
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return budget

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        stop = start + num_new
        return ScheduledChunk(request=request, start=start, token_ids=request.token_slice(start, stop),
                              page_ids=self.page_table.page_ids(request.request_id),
                              samples=stop == request.num_tokens)

    def _cache_salt(self, request: Request) -> str | None:
        """The request's prefix-cache salt, on its side of `recompute_past` (see the module's notes)."""
        past = self.config.recompute_past
        if past is None or request.num_tokens <= past:
            return request.cache_salt
        return f"{request.cache_salt or ''}\x00past-{past}"

    def _preempt(self, request: Request, *, recompute: bool = False) -> None:
        """Back to waiting, to recompute prompt + output so far: a preemption, or with `recompute`
        the request passing `recompute_past`."""
        self._running.remove(request)
        del self._admission_key[request]
        self.page_table.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if recompute:
            self.num_recomputes += 1
        else:
            request.num_preemptions += 1
            self.num_preemptions += 1
        bisect.insort(self._waiting, request, key=self._arrival_key.__getitem__)
        logger.debug("%s %s at %d tokens", "recomputing" if recompute else "preempted", request.request_id,
                     request.num_tokens)

    def update(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[Request]:
        """Records a step's results.

        Args:
          plan: the plan `schedule()` returned, after the device ran it.
          sampled: request id -> sampled token, for (at least) every chunk with `samples=True`.
        Returns:
          The requests that got a new token, in plan order. Those that reached `max_len` are
          already finished (status FINISHED_LENGTH, pages freed), one that passed `recompute_past`
          waits to be recomputed; the engine checks the rest for stops.
        """
        now = None
        new_token = []
        for chunk in plan.chunks:
            request = chunk.request
            if self._requests.get(request.request_id) is not request:
                continue  # aborted or finished while the step ran
            assert request.status is RequestStatus.RUNNING and request.num_computed_tokens == chunk.start
            self.page_table.mark_computed(request.request_id, chunk.num_tokens)
            request.num_computed_tokens += chunk.num_tokens
            if not chunk.samples:
                continue
            token = sampled.get(request.request_id)
            if token is None:
                raise ValueError(f"no sampled token for request {request.request_id!r}")
            token = operator.index(token)  # a plain int, even from a numpy array
            request.output_token_ids.append(token)
            self.page_table.append_tokens(request.request_id, [token])
            if request.first_token_time is None:
                now = self.clock() if now is None else now
                request.first_token_time = now
            if request.num_tokens >= self.max_len:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
            elif request.num_tokens == (self.config.recompute_past or -2) + 1:
                self._preempt(request, recompute=True)  # it passed recompute_past with this sample
            new_token.append(request)
        return new_token

    def patch_token(self, request: Request, index: int, token: int) -> None:
        """Async scheduling: `update` recorded output `index` of `request` as a placeholder (the
        step's sample was still on the device); this is its value. The page table's copy is set
        too while the request holds its pages (a preempted or finished one holds none)."""
        request.output_token_ids[index] = operator.index(token)
        if (self._requests.get(request.request_id) is request and request.status is RequestStatus.RUNNING
                and request.request_id in self.page_table):
            self.page_table.set_token(request.request_id, len(request.prompt_token_ids) + index, token)

    def check_invariants(self) -> None:
        """Asserts the queues agree with each other and with the page table (between steps)."""
        assert len(self._running) <= self.config.max_num_seqs
        assert {r.request_id for r in self._waiting + self._running} == set(self._requests)
        assert len(self._waiting) + len(self._running) == len(self._requests)
        assert self._waiting == sorted(self._waiting, key=self._arrival_key.__getitem__)
        assert self._running == sorted(self._running, key=self._admission_key.__getitem__)
        assert set(self._arrival_key) == set(self._waiting) | set(self._running)
        assert set(self._admission_key) == set(self._running)
        for request in self._waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request.request_id
            assert request.num_computed_tokens == 0 and request.request_id not in self.page_table
        for request in self._running:
            rid = request.request_id
            assert request.status is RequestStatus.RUNNING, rid
            assert self.page_table.num_computed_tokens(rid) == request.num_computed_tokens, rid
            assert self.page_table.num_allocated_tokens(rid) == request.num_computed_tokens, rid
            assert self.page_table.num_tokens(rid) == request.num_tokens < self.max_len, rid
            assert request.num_computed_tokens < request.num_tokens, rid
        assert self.page_table.num_requests == len(self._running)
        self.page_table.check_invariants()

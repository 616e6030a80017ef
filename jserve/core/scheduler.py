"""Iteration-level scheduling: token budget, chunked prefill, prefix reuse, preemption and the
token-level stops (pure Python).

`schedule()` plans one step (`StepPlan`); after the device ran it, `update()` records the sampled
tokens and ends the sequences a token stops: EOS, stop ids, `max_tokens`, the context length, a
grammar that completes or refuses the token. Stop strings need the text: the engine checks them
beside the detokenizer and calls `finish_request`. docs/architecture.md ("Scheduling") gives the
orders, the budget, preemption, capacity, multi-step decode, recompute past a length,
speculative drafts' pages and aborts.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import operator
import time
from collections.abc import Callable, Mapping

from jserve.core.lora_slots import LoraSlots
from jserve.core.page_table import PageTable

# The plan's types are this module's vocabulary too (and importable from here).
from jserve.core.plan import PLACEHOLDER, Request, RequestStatus, ScheduledChunk, SchedulerProtocol, StepPlan
from jserve.core.scheduler_config import SchedulerConfig, tokens_before_recompute
from jserve.core.stop import Stop, StopPolicy, tokens_left

__all__ = ["Request", "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerConfig",
           "SchedulerProtocol", "StepPlan", "tokens_before_recompute"]

logger = logging.getLogger(__name__)


class Scheduler:
    """Turns waiting and running requests into one `StepPlan` per step over a `PageTable`."""

    def __init__(self, config: SchedulerConfig, page_table: PageTable,
                 clock: Callable[[], float] = time.monotonic, stop_policy: StopPolicy | None = None,
                 lora_slots: LoraSlots | None = None):
        """`stop_policy`: the model's EOS and stop-id rules for `update` (None: only max_len and
        grammars end a request here; the caller decides the rest). `lora_slots`: the model's LoRA
        slots (shared by every data-parallel group's scheduler); a request with an adapter is
        admitted once its adapter has a slot, and holds it while it runs."""
        if config.enable_prefix_caching != page_table.enable_prefix_caching:
            raise ValueError(f"config.enable_prefix_caching={config.enable_prefix_caching} but "
                             f"page_table.enable_prefix_caching={page_table.enable_prefix_caching}")
        self.config = config
        self.page_table = page_table
        self.clock = clock
        pool_tokens = page_table.max_tokens(config.max_num_batched_tokens, config.max_model_len)
        self.max_len = min(config.max_model_len, pool_tokens + 1)
        self.num_preemptions = 0
        self.num_recomputes = 0  # requests recomputed as they passed `recompute_past`
        self.stop_policy = stop_policy
        self.lora_slots = lora_slots
        self.num_grammar_errors = 0  # sampled tokens a grammar refused (a bug if ever > 0)
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
        if request.lora_name is not None and self.lora_slots is None:
            raise ValueError(f"request {request.request_id!r} names LoRA adapter {request.lora_name!r}, "
                             f"but LoRA is not enabled")
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

    def finish_request(self, request_id: str, status: RequestStatus, stop: Stop | None = None) -> None:
        """Ends a request with a stop the engine found (a stop string); a no-op if it already finished."""
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status}")
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, status, stop)

    def _finish(self, request: Request, status: RequestStatus, stop: Stop | None = None) -> None:
        del self._requests[request.request_id]
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            del self._admission_key[request]
            self.page_table.free(request.request_id)
            self._release_lora(request)
        else:
            self._waiting.remove(request)
        del self._arrival_key[request]
        request.status = status
        request.stop = stop
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
        if any(r.params.bans_depend_on_output for r in running):
            return None  # so do the bans of a bad word of several tokens
        steps = [self._num_decode_steps(r) for r in running]
        if self._waiting:
            # Someone waits for a seat: end the call when the first seat frees by max_tokens or
            # max_len, rather than leave it empty for the rest of the call.
            steps = [min(steps)] * len(steps)
            if steps[0] == 1:
                return None
        table = self.page_table
        if not table.can_allocate_lookahead([(r.request_id, n - 1) for r, n in zip(running, steps)]):
            return None  # the single step preempts as it must
        chunks = []
        for request, n in zip(running, steps):
            allocated = table.allocate_slots(request.request_id, 1, num_lookahead=n - 1)
            assert allocated, "counted above"
            chunk = self._chunk(request, 1)
            chunk.decode_steps = n
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
        if chunk.num_tokens != 1 or not chunk.emits_token:
            raise ValueError("drafts follow a decode chunk (one token, sampled)")
        if num_drafts <= 0:
            return num_drafts == 0
        if not self.page_table.allocate_slots(request.request_id, 0, num_lookahead=num_drafts):
            return False
        chunk.page_ids = self.page_table.page_ids(request.request_id)
        chunk.local_page_ids = self.page_table.local_page_ids(request.request_id)
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
            if request.lora_name is not None:
                slot = self.lora_slots.acquire(request.lora_name)
                if slot is None:
                    break  # every slot pinned: the head waits for one
                request.lora_slot = slot
            hit = self.page_table.allocate_prompt(request.request_id, token_ids, num_new_tokens=num_new,
                                                  cache_salt=salt)
            if hit is None:
                self._release_lora(request)
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
                              local_page_ids=self.page_table.local_page_ids(request.request_id),
                              emits_token=stop == request.num_tokens)

    def _cache_salt(self, request: Request) -> str | None:
        """The request's prefix-cache salt, on its side of `recompute_past` (see the module's notes)."""
        past = self.config.recompute_past
        if past is None or request.num_tokens <= past:
            return request.prefix_salt
        return f"{request.prefix_salt or ''}\x00past-{past}"

    def _release_lora(self, request: Request) -> None:
        """The request's adapter slot is no longer pinned by it (it stopped running)."""
        if request.lora_slot:
            self.lora_slots.release(request.lora_name)
            request.lora_slot = 0

    def _preempt(self, request: Request, *, recompute: bool = False) -> None:
        """Back to waiting, to recompute prompt + output so far: a preemption, or with `recompute`
        the request passing `recompute_past`."""
        self._running.remove(request)
        del self._admission_key[request]
        self.page_table.free(request.request_id)
        self._release_lora(request)
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
          sampled: request id -> sampled token, for (at least) every chunk with `emits_token=True`.
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
            if not chunk.emits_token:
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
                self._finish(request, RequestStatus.FINISHED_LENGTH, Stop("length"))
            elif token != PLACEHOLDER and self._token_stops(request, token):
                pass
            elif request.num_tokens == (self.config.recompute_past or -2) + 1:
                self._preempt(request, recompute=True)  # it passed recompute_past with this sample
            new_token.append(request)
        return new_token

    def _token_stops(self, request: Request, token: int) -> bool:
        """Feed a sampled token to the request's grammar and end the request where a stop rule
        says so: a refused token aborts it (its mask should make that impossible; the library's
        per-step limits can), EOS and stop ids stop it, then max_tokens or a complete grammar
        (weak stops: a stop string the engine finds in the same token comes first)."""
        grammar = request.grammar
        if grammar is not None and not grammar.consume(token):
            self.num_grammar_errors += 1
            logger.error("request %s: its grammar refused sampled token %d (%s); aborting it",
                         request.request_id, token, grammar.error)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            return True
        policy = self.stop_policy
        stop = None if policy is None else policy.check_token(request.params, token, len(request.output_token_ids))
        if (stop is None or stop.finish_reason == "length") and grammar is not None and grammar.is_stopped:
            stop = Stop("stop", weak=True)  # a document complete at max_tokens stopped, not cut
        if stop is not None:
            self._finish(request, RequestStatus[stop.status_name], stop)
        return stop is not None

    def fill_placeholder(self, request: Request, index: int, token: int) -> None:
        """Async scheduling: `update` recorded output `index` of `request` as a placeholder (the
        step's sample was still on the device); this is its value, checked for stops now. The
        page table's copy is set too while the request holds its pages."""
        request.output_token_ids[index] = operator.index(token)
        if self._requests.get(request.request_id) is not request:
            return  # finished (at the context length: no stop check), or aborted
        if request.status is RequestStatus.RUNNING and request.request_id in self.page_table:
            self.page_table.set_token(request.request_id, len(request.prompt_token_ids) + index, token)
        self._token_stops(request, operator.index(token))

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

"""The contract between the scheduler and the engine: a request's state (`Request`,
`RequestStatus`), one step's work (`ScheduledChunk`s in a `StepPlan`), and what a scheduler
offers (`SchedulerProtocol`, which `Scheduler` and `DataParallelScheduler` implement). Pure Python.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Protocol

from jserve.core.request import SamplingParams
from jserve.core.stop import Stop

PLACEHOLDER = -1  # async scheduling: a sampled token still on the device


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to recompute prompt + output so far
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI / `CompletionOutput.finish_reason` word, None while unfinished."""
        return self.value if self.is_finished else None


@dataclasses.dataclass(eq=False)
class Request:
    """The engine's mutable per-request state; identity-hashed."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0  # lower runs first; first come first served among equals
    cache_salt: str | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V is written (0 while waiting)
    num_cached_tokens: int = 0  # prefix-cache hit tokens at first admission (usage reports)
    # Its grammar matcher (structured outputs; `jserve.structured.grammar.GrammarMatcher`): the
    # scheduler's update feeds it each sampled token.
    grammar: Any = None
    stop: Stop | None = None  # what ended it, where a stop rule did (None: running, aborted)
    lora_name: str | None = None  # its LoRA adapter (`jserve.core.lora_slots`); None: the base model
    lora_slot: int = 0  # the model's slot holding that adapter while it runs; 0: none
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefix_salt(self) -> str | None:
        """Its prefix-cache salt: `cache_salt`, and its adapter's name (an adapter's K/V is its own)."""
        if self.lora_name is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora-{self.lora_name}"

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` without copying the whole history (a decode needs one token)."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - num_prompt]


@dataclasses.dataclass
class ScheduledChunk:
    request: Request
    start: int  # position of the first token computed this step (= tokens computed before)
    token_ids: list[int]  # the tokens fed this step: all_token_ids[start:start + n]
    page_ids: list[int]  # the request's pages after allocation (enough for start + n tokens)
    emits_token: bool  # the chunk reaches the last known token: its last logit's sample is kept
    decode_steps: int = 1  # decode steps this call runs for the request (> 1: multi-step decode)
    local_page_ids: list[int] | None = None  # hybrid pages: the sliding layers' own (`HybridPageTable`)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass
class StepPlan:
    """One step's work: the chunks to compute, in row order, and what scheduling them did."""

    chunks: list[ScheduledChunk]
    preempted: list[Request]
    num_batched_tokens: int
    dp_groups: list[int] | None = None  # chunk i's data-parallel group (None: all in group 0)

    def __post_init__(self):
        if self.dp_groups is None:
            self.dp_groups = [0] * len(self.chunks)
        if len(self.dp_groups) != len(self.chunks):
            raise ValueError(f"{len(self.dp_groups)} dp_groups for {len(self.chunks)} chunks")

    @property
    def decode_steps(self) -> int:
        """Decode steps of the device call: > 1 for a multi-step decode."""
        return max((c.decode_steps for c in self.chunks), default=1)


class SchedulerProtocol(Protocol):
    """What the engine drives: `Scheduler`, or `DataParallelScheduler` over one per group."""

    num_preemptions: int
    num_recomputes: int
    num_grammar_errors: int

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    def has_unfinished(self) -> bool: ...

    def get_request(self, request_id: str) -> Request | None: ...

    def add_request(self, request: Request) -> None: ...

    def abort_request(self, request_id: str) -> Request | None: ...

    def finish_request(self, request_id: str, status: RequestStatus, stop: Stop | None = None) -> None: ...

    def fill_placeholder(self, request: Request, index: int, token: int) -> None: ...

    def schedule(self) -> StepPlan: ...

    def next_decode_step(self, chunk: ScheduledChunk) -> ScheduledChunk | None: ...

    def reserve_drafts(self, chunk: ScheduledChunk, num_drafts: int) -> bool: ...

    def release_lookahead(self, request_id: str) -> int: ...

    def update(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[Request]: ...

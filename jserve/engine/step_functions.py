"""The engine's execute phase: a step function, chosen once when the engine is built, runs a
plan on the runner and returns what the update phase takes (`StepResult`). `PlainStep` runs one
call per plan, `MultiStep` a multi-step decode where the plan asks for one, `OverlappedStep`
launches a plan before reading the step before it (async scheduling);
`jserve.engine.speculative.SpeculativeStep` verifies drafts. See docs/architecture.md."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jserve.core.plan import PLACEHOLDER, Request, StepPlan
from jserve.core.stop import StopPolicy
from jserve.runtime.overlap import Launched
from jserve.runtime.steps import StepOutput, StepRow


@dataclasses.dataclass(frozen=True)
class Placeholder:
    """A sample recorded in the scheduler before the host read it (async scheduling)."""

    request: Request
    index: int  # its index in the request's output
    row: int  # its row in the launched call's outputs


@dataclasses.dataclass
class Executed:
    """One device call's samples for a plan's chunks, a row per chunk in order (with a leading
    axis of steps and `out.num_valid` for a multi-step decode or a verify call)."""

    plan: StepPlan
    out: StepOutput
    # Async scheduling: the chunks' samples went into the scheduler as placeholders when the call
    # was launched; the update fills them.
    filled: list[Placeholder] | None = None
    steps: int | None = 1  # engine steps it counts (None: the decode steps the update takes)


@dataclasses.dataclass
class StepResult:
    """What a step function hands the update phase: its calls' samples, in the order to take
    them, and the bookkeeping to run once they are taken and the outputs made."""

    executed: list[Executed] = dataclasses.field(default_factory=list)
    then: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    launched: int = 0  # steps dispatched whose samples a later step reads (async scheduling)


def step_rows(plan: StepPlan, stop_policy: StopPolicy) -> list[StepRow]:
    """The runner's rows for a plan's chunks (their requests are the engine's `SequenceState`s)."""
    rows = []
    for chunk, dp_group in zip(plan.chunks, plan.dp_groups):
        req = chunk.request
        # Stop ids on the device: only a multi-step call checks them.
        stop_ids, min_new = (stop_policy.device_stops(req.params, len(req.output_token_ids))
                             if chunk.decode_steps > 1 else ((), 0))
        rows.append(StepRow.from_chunk(chunk, dp_group=dp_group, stop_ids=stop_ids, min_new=min_new,
                                       prompt_targets=req.prompt_targets(chunk)))
    return rows


def sub_plan(plan: StepPlan, index) -> StepPlan:
    """The plan's chunks at `index` only."""
    chunks = [plan.chunks[i] for i in index]
    return StepPlan(chunks=chunks, preempted=[], num_batched_tokens=sum(c.num_tokens for c in chunks),
                    dp_groups=[plan.dp_groups[i] for i in index])


class PlainStep:
    """One `Runner.execute` call per plan."""

    def __init__(self, runner: Any, stop_policy: StopPolicy):
        self.runner = runner
        self.stop_policy = stop_policy

    def rows(self, plan: StepPlan) -> list[StepRow]:
        return step_rows(plan, self.stop_policy)

    def __call__(self, plan: StepPlan) -> StepResult:
        return StepResult([Executed(plan, self.runner.execute(self.rows(plan)))] if plan.chunks else [])


class MultiStep(PlainStep):
    """A multi-step decode (`Runner.execute_decode_steps`) where the scheduler planned one."""

    def __call__(self, plan: StepPlan) -> StepResult:
        if plan.decode_steps == 1:
            return super().__call__(plan)
        return StepResult([Executed(plan, self.runner.execute_decode_steps(self.rows(plan)), steps=None)])


@dataclasses.dataclass
class InFlight:
    """A launched step whose samples the host has not read."""

    plan: StepPlan
    launched: Launched
    placeholders: list[Placeholder]


class OverlappedStep(PlainStep):
    """Async scheduling: launch the plan (`Runner.launch`) before reading the step in flight, its
    decode rows fed from that step's samples on the device; then record the plan's samples as
    placeholders (after the outputs are made: a request the update ends at the context length
    shows its last token once it is read). A plan that needs the tokens before it on the host
    (penalties, a grammar's mask, prompt logprobs) runs after the step in flight is read. Its
    rows never need a placeholder's value: such a request's samples are never launched."""

    def __init__(self, runner: Any, stop_policy: StopPolicy, scheduler: Any):
        super().__init__(runner, stop_policy)
        self.scheduler = scheduler
        self.inflight: InFlight | None = None
        self.num_sync_steps = 0  # steps that waited for the one before

    def __call__(self, plan: StepPlan) -> StepResult:
        inflight, self.inflight = self.inflight, None
        launched = self._launch(plan, inflight) if plan.chunks and self._may_launch(plan) else None
        result = StepResult()
        if inflight is not None:
            out = self.runner.collect(inflight.launched)
            result.executed.append(Executed(inflight.plan, out, filled=inflight.placeholders, steps=0))
        if launched is not None:
            result.then.append(lambda: self._record(plan, launched))
            result.launched = 1
        elif plan.chunks:  # it runs now, with the tokens just read
            read = {} if inflight is None else {p.request.request_id: int(out.tokens[p.row])
                                                for p in inflight.placeholders}
            for c in plan.chunks:
                if PLACEHOLDER in c.token_ids:
                    c.token_ids = [read[c.request.request_id] if t == PLACEHOLDER else t for t in c.token_ids]
            self.num_sync_steps += 1
            result.executed.append(Executed(plan, self.runner.execute(self.rows(plan))))
        return result

    def _launch(self, plan: StepPlan, inflight: InFlight | None) -> Launched | None:
        """Dispatch the plan, each placeholder token fed from the step in flight; None where a
        placeholder has no row there to come from."""
        slot = {} if inflight is None else {p.request.request_id: inflight.launched.slots[p.row]
                                            for p in inflight.placeholders}
        feed = [slot.get(c.request.request_id, -1) if list(c.token_ids) == [PLACEHOLDER] else -1
                for c in plan.chunks]
        if any(PLACEHOLDER in c.token_ids and f < 0 for c, f in zip(plan.chunks, feed)):
            return None
        return self.runner.launch(self.rows(plan), inflight and inflight.launched, feed)

    def _may_launch(self, plan: StepPlan) -> bool:
        """Whether no row needs the tokens before it on the host."""
        if plan.decode_steps != 1:
            return False
        return not any(c.request.prompt_targets(c) is not None or (c.emits_token and (
            c.request.params.has_penalties or c.request.grammar is not None
            or c.request.params.bans_depend_on_output)) for c in plan.chunks)

    def _record(self, plan: StepPlan, launched: Launched) -> None:
        took = self.scheduler.update(plan, {c.request.request_id: PLACEHOLDER for c in plan.chunks if c.emits_token})
        row = {c.request.request_id: i for i, c in enumerate(plan.chunks)}
        self.inflight = InFlight(plan, launched, [Placeholder(r, len(r.output_token_ids) - 1, row[r.request_id])
                                                  for r in took])

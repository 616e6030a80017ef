"""The overlap of consecutive steps (async scheduling): step N+1 is dispatched before the host
reads step N's samples, and the decode rows' input tokens of N+1 come from N's samples on the
device.

`OverlapLauncher.launch` dispatches a step as one call and returns a `Launched` without waiting;
`collect` reads it. A launched call's sampler also writes its tokens into a fixed-size vector
(`feed_rows` entries), and `feed_tokens` scatters the entries the next call names into that
call's packed tokens. See docs/architecture.md ("Async scheduling").
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

from jserve.runtime.steps import StepOutput, StepRecord, StepRow


def feed_tokens(tokens, prev, dst, src):
    """`tokens` (a call's packed input ids, any shape) with flat entries `dst` replaced by
    `prev[src]` (the previous call's samples); a `dst` past the end is dropped (padding)."""
    flat = tokens.reshape(-1)
    flat = flat.at[dst].set(prev[src].astype(flat.dtype), mode="drop")
    return flat.reshape(tokens.shape)


def feed_indices(targets: Sequence[int], sources: Sequence[int], size: int, num_tokens: int):
    """The `dst`, `src` int32 arrays of `size` entries for `feed_tokens`: flat token index ->
    previous call's sample row, padded with `num_tokens` (out of range: dropped) and row 0."""
    if len(targets) > size:
        raise ValueError(f"{len(targets)} fed tokens exceed the {size} rows a call samples")
    dst = np.full(size, num_tokens, np.int32)
    src = np.zeros(size, np.int32)
    dst[:len(targets)] = targets
    src[:len(sources)] = sources
    return dst, src


@dataclasses.dataclass
class Launched:
    """A step dispatched by `Runner.launch` and not read yet."""

    kind: str  # "decode" | "mixed"
    shape: tuple[int, int]  # (B, T) of the call
    rows: list  # the StepRows, in the order given
    slots: list[int]  # each row's sample row in the call's outputs
    out: dict[str, Any]  # the sampler's device outputs (without "feed")
    feed: Any  # int32 [feed_rows] device array: the samples, for the next call
    dispatched: float  # perf_counter() when it was dispatched
    # Whether the call before it was still running when it was dispatched (no gap on the device).
    overlapped: bool = False
    compiled: bool | None = None  # whether dispatching it compiled (None: JAX does not say)
    # The device's idle time before it (at most; None: the first step of a busy period).
    idle_before: float | None = None
    seen_running: float = 0.0  # the last time it was known to be running (`ready()` False)

    def ready(self) -> bool:
        """Whether the device has finished it (without waiting)."""
        try:
            done = bool(self.feed.is_ready())
        except AttributeError:  # not a jax.Array: nothing to wait for
            return True
        if not done:
            self.seen_running = time.perf_counter()
        return done


class OverlapLauncher:
    """A runner's launched steps: dispatch without waiting, the on-device token feed, collect."""

    def __init__(self, runner: Any):
        self.runner = runner
        mesh = runner.mesh
        # Its tokens out as `Runner.place` puts a call's (rows over dp): one compiled forward for both.
        if mesh is None:
            self.feed_fn = jax.jit(feed_tokens)
        else:
            from jserve.runtime.sharding import rows_sharding

            self.feed_fn = jax.jit(feed_tokens, out_shardings=rows_sharding(mesh))
        self.last_feed = None  # the last call's samples as `launch` feeds them (warm-up uses it)
        self.num_launched = 0  # steps dispatched by `launch`
        self.num_overlapped = 0  # ... while the step before them was still running

    def launch(self, rows: Sequence[StepRow], after: Launched | None = None,
               feed: Sequence[int] | None = None) -> Launched | None:
        """Dispatch one step as one call and return without waiting for it. Row i with `feed[i]` =
        j >= 0 is a decode row whose token is `after`'s sample in its row j (`Launched.slots`): the
        device puts it there, so the host need not know it. None (nothing dispatched) where the
        rows need more than one call, a prompt-logprob, multi-step or verify call, or the runner
        spans several groups or processes: `execute` them."""
        runner = self.runner
        feed = list(feed) if feed is not None else [-1] * len(rows)
        if len(feed) != len(rows):
            raise ValueError(f"{len(feed)} feed entries for {len(rows)} rows")
        if any(j >= 0 for j in feed) and after is None:
            raise ValueError("a fed row needs the launched step it takes its token from")
        for r, j in zip(rows, feed):
            if j >= 0 and (r.num_tokens != 1 or r.penalty_tokens is not None or r.grammar_matcher is not None
                           or r.sampling.bans_depend_on_output):
                raise ValueError("a fed row is a decode row without penalties, a grammar or a bad word of "
                                 "several tokens (all need its token on the host)")
        if (not rows or not runner.launchable
                or any(r.prompt_targets is not None or r.decode_steps != 1 or r.draft_ids for r in rows)):
            return None
        kind = "mixed" if any(r.num_tokens > 1 for r in rows) else "decode"
        if kind == "mixed" and len(runner.pack_mixed([r.num_tokens for r in rows])) > 1:
            return None
        if kind == "decode" and len(rows) > runner.batch_buckets[-1]:
            return None
        call = runner.prepare(rows, [list(range(len(rows)))], kind)
        B, T = call.B, call.T
        # A fed row's token in the call's flat tokens: a decode row's is its row's (T = 1); a
        # mixed step's rows index their last token within the one group's tokens (`last`).
        last = np.asarray(call.inputs.last).reshape(-1)
        targets = [call.slot_of[i] * T if kind == "decode" else int(last[call.slot_of[i]])
                   for i, j in enumerate(feed) if j >= 0]
        sources = [j for j in feed if j >= 0]
        fed = None
        if targets:
            dst, src = feed_indices(targets, sources, runner.feed_rows, B * T)
            fed = (after.feed, dst, src)
        overlapped = after is not None and not after.ready()
        t0 = time.perf_counter()
        out, compiled = runner.compiles.dispatched(
            (kind, B, T), runner.compiled_fns, lambda: runner.device_step(call.inputs, runner.grammar_rows(call.placed),
                                                                           fed=fed))
        self.num_launched += 1
        self.num_overlapped += overlapped
        # The device's gap before it: none when the call before still ran; else at most the time
        # since that one was last seen running.
        idle = None if after is None else 0.0 if overlapped else max(0.0, t0 - after.seen_running)
        return Launched(kind, (B, T), list(rows), [call.slot_of[i] for i in range(len(rows))], out,
                        out.pop("feed"), t0, overlapped, compiled, idle_before=idle, seen_running=t0)

    def collect(self, launched: Launched) -> StepOutput:
        """Wait for a launched step and read its samples (one per row, in its rows' order)."""
        runner = self.runner
        out = jax.device_get(launched.out)
        end = time.perf_counter()
        # The device started it when it was dispatched, or, dispatched while the call before
        # ran, once that one ended (at the latest when the host read that one).
        start = launched.dispatched
        if launched.overlapped and runner.step_log.last_end is not None:
            start = max(start, runner.step_log.last_end)
        kind, (B, T), rows = launched.kind, launched.shape, launched.rows
        runner.step_log.add(StepRecord(kind, (B, T), sum(r.num_tokens for r in rows),
                                       T if kind == "mixed" else B * T, end - start, *runner.cost(rows)),
                            idle=launched.idle_before)
        return StepOutput.from_arrays({key: np.asarray(value)[launched.slots] for key, value in out.items()})

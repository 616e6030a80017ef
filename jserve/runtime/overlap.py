"""The overlap of consecutive steps (async scheduling): step N+1 is dispatched before the host
reads step N's samples, and the decode rows' input tokens of N+1 come from N's samples on the
device.

`Runner.launch` dispatches a step as one call and returns a `Launched` without waiting; the
engine (`jserve.engine.llm_engine`, `EngineConfig.async_scheduling`) then plans and launches the
next step and only after that calls `Runner.collect` on the first. A launched call's sampler also
writes its tokens into a fixed-size vector (`feed_rows` entries, `device_steps.sample_rows`), and
`feed_tokens` scatters the entries the next call names into that call's packed tokens, one jitted
function per token shape, compiled with the step's shapes at warm-up.

Pure device functions and bookkeeping; the runner owns the calls.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import numpy as np


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

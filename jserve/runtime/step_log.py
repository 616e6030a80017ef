"""The step log: what each compiled call did (`StepRecord`), for metrics and benchmarks, with
listeners a benchmark subscribes to instead of patching the runner."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

from jserve.runtime.steps import StepRecord


class StepLog:
    """Recent `StepRecord`s, the real and padded tokens since warm-up, and the host time between
    calls (`StepRecord.idle_before`: the device idles)."""

    def __init__(self, maxlen: int = 4096):
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=maxlen)
        self.total_real_tokens = 0
        self.total_padded_tokens = 0
        self._last_end: float | None = None  # when the last call returned (None: idle)
        self._listeners: list[Callable[[StepRecord], None]] = []

    def subscribe(self, listener: Callable[[StepRecord], None]) -> Callable[[], None]:
        """Call `listener(record)` after each call; returns the function that unsubscribes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    @property
    def last_end(self) -> float | None:
        return self._last_end

    def add(self, record: StepRecord, idle: float | None = None) -> None:
        """`idle`: the gap before it where the caller knows it (a launched step), else the time
        since the last call returned."""
        end = time.perf_counter()  # the call just returned: it started `record.seconds` ago
        if idle is not None:
            record = dataclasses.replace(record, idle_before=idle)
        elif self._last_end is not None:
            record = dataclasses.replace(record, idle_before=max(0.0, end - record.seconds - self._last_end))
        self._last_end = end
        self.records.append(record)
        self.total_real_tokens += record.real_tokens
        self.total_padded_tokens += record.padded_tokens
        for listener in self._listeners:
            listener(record)

    def mark_idle(self) -> None:
        """Nothing left to run: the wait until the next call is not a gap between steps."""
        self._last_end = None

    def reset(self) -> None:
        """Forget everything so far (after warm-up)."""
        self.records.clear()
        self.total_real_tokens = self.total_padded_tokens = 0
        self.mark_idle()

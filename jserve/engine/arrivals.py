"""Requests on their way to the engine: the server has begun to read them, their add has not been
queued yet. `AsyncLLMEngine` waits for them (briefly) before the first step after an idle spell.

Why: requests that come together (a client's burst) reach the server within a millisecond or so,
but each is read, validated and tokenized on the event loop one after the other. The engine thread
wakes at the first one's add and would start a prefill step for it alone; the others, queued a
moment later, then wait for that whole step and share the next with the first one's decode: a step
more to their first token. While the engine is busy a new request joins the next step anyway, so
the wait is only for the step that starts from idle, ends as soon as every expected request is
queued (or has failed), and never lasts more than `timeout` seconds.

The server marks a request as expected for as long as its route runs (`expect`); the request's
first add, from the same task (a context variable carries the mark into the engine's `generate`),
settles it. Thread-safety: every count change holds the engine's condition, and wakes its thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from typing import Iterator


class _Mark:
    __slots__ = ("settled",)

    def __init__(self):
        self.settled = False


_CURRENT: contextvars.ContextVar[_Mark | None] = contextvars.ContextVar("jserve_expected_request", default=None)


class Arrivals:
    """The count of expected requests, kept under the engine thread's condition `cond`."""

    def __init__(self, cond: threading.Condition):
        self._cond = cond
        self.pending = 0

    @contextlib.contextmanager
    def expect(self) -> Iterator[None]:
        """The block reads a request that will (or may) be added: counted until its first add is
        queued or the block ends."""
        mark = _Mark()
        with self._cond:
            self.pending += 1
        token = _CURRENT.set(mark)
        try:
            yield
        finally:
            _CURRENT.reset(token)
            with self._cond:
                self._settle(mark)

    def on_add(self) -> None:
        """An add is being queued (the caller holds the condition): it settles the expectation of
        the task it comes from, if any."""
        mark = _CURRENT.get()
        if mark is not None:
            self._settle(mark)

    def _settle(self, mark: _Mark) -> None:
        if not mark.settled:
            mark.settled = True
            self.pending -= 1
            self._cond.notify()

    def gather(self, timeout: float) -> None:
        """On the engine thread, holding the condition: wait while expected requests are still on
        their way, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.pending > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

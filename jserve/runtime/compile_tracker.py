"""Counting compilations (a server must prove none happens after warm-up) and the one timed
call every compiled step goes through."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

import jax

logger = logging.getLogger(__name__)


def cache_size(fn) -> int | None:
    """Entries in a jitted function's compilation cache (None if this JAX does not say)."""
    size = getattr(fn, "_cache_size", None)
    return size() if callable(size) else None


def total_cache_size(fns: Iterable[Any]) -> int | None:
    sizes = [cache_size(f) for f in fns]
    return None if None in sizes else sum(sizes)


class CompileTracker:
    """Which step shapes compiled: all of them, those after warm-up (a stall while serving),
    and the prompt-logprob step's (compiled on first use, counted apart)."""

    def __init__(self):
        self.num_compilations = 0
        self.num_after_warmup = 0
        self.num_score = 0
        self.warmed_up = False
        self.seen: set[tuple] = set()  # the shape keys run so far
        self.ahead: Callable[[tuple], bool] = lambda key: False  # compiled ahead (lazy buckets)

    def is_new(self, key: tuple, compiled: bool | None) -> bool:
        """Whether a call compiled: its jitted function's cache grew (or, where JAX does not tell,
        its shape `key` is new). The cache also grows on a persistent-cache hit: still a stall."""
        if compiled is None:
            compiled = key not in self.seen
        self.seen.add(key)
        return compiled

    def count(self, key: tuple, compiled: bool | None, *, score: bool = False) -> None:
        """Count a call's compilation. A shape compiled ahead by the lazy buckets' thread grows
        its function's cache on its first call without compiling."""
        if self.ahead(key):
            compiled = False
        if not self.is_new(key, compiled):
            return
        if score:
            self.num_score += 1
            return
        self.num_compilations += 1
        if self.warmed_up:
            self.num_after_warmup += 1
            logger.warning("compiled %s after warm-up", key)

    def timed(self, key: tuple, fns: Callable[[], Iterable[Any]], call: Callable[[], Any], *,
              score: bool = False) -> tuple[Any, float]:
        """Run `call` (a compiled step), fetch its outputs to the host and count whether it
        compiled (`fns()`: the jitted functions it may grow); returns (host outputs, seconds)."""
        cached = total_cache_size(fns())
        t0 = time.perf_counter()
        out = jax.device_get(call())
        seconds = time.perf_counter() - t0
        self.count(key, None if cached is None else total_cache_size(fns()) > cached, score=score)
        return out, seconds

    def dispatched(self, key: tuple, fns: Callable[[], Iterable[Any]],
                   call: Callable[[], Any]) -> tuple[Any, bool | None]:
        """Dispatch `call` without waiting (a launched step); returns its device outputs and
        whether it compiled (None: JAX does not say)."""
        cached = total_cache_size(fns())
        out = call()
        compiled = None if cached is None else total_cache_size(fns()) > cached
        self.count(key, compiled)
        return out, compiled

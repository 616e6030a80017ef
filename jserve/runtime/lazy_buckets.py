"""Lazy buckets: which compiled step shapes a runner may use now, and a thread compiling the rest.

`Runner.warmup(lazy=True)` compiles, by running them as a full warm-up does, only the shapes that
serve any step on their own: the largest decode batch, the mixed step of the most rows over the
largest token bucket (and the largest multi-step decode and verify batches when those steps exist), and
one stream's own (`warmup.single_stream_shapes`: a lone request runs at speed from the start). The other
shapes go to `BucketCompiler.start`: one daemon thread lowers and compiles each ahead of time
(`jax.jit(f).lower(...).compile()`: JAX keeps the executable, so the first call of that shape
compiles nothing; tests/test_lazy_buckets.py checks this with JAX's compile events). Until a shape
is ready, `cover` picks the smallest ready one that holds the call, padding it further, and the
runner counts the fallback. Nothing compiles on the serving path.

The thread competes with the steps for the CPU (and the GIL while it lowers), so a shape a call fell
back from is compiled next, and the others (in `start`'s order) only while the runner is idle: a
loaded server compiles the shapes its load needs, and the rest once it is quiet.

Pure bookkeeping plus the thread: the runner supplies each shape's compile job.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from typing import Callable, Iterable, Iterator, Sequence

logger = logging.getLogger(__name__)
_LIVE: "weakref.WeakSet[BucketCompiler]" = weakref.WeakSet()  # compilers whose thread was started


def stop_all(timeout: float | None = 60.0) -> None:
    """Stop every running compiler's thread (after its current shape): before JAX's persistent
    compilation cache is reopened elsewhere, which a thread reading it would crash on."""
    for compiler in list(_LIVE):
        compiler.stop(timeout)


atexit.register(stop_all)  # registered after JAX's own exit handlers, so it runs before them

Key = tuple  # (kind, global batch, tokens per row), as Runner._count names a shape
POLL_S = 0.05  # how often a thread held back by a busy runner looks again


class BucketCompiler:
    """The shapes ready to run, and the background thread that makes the others ready."""

    def __init__(self, ready: Iterable[Key] = (), busy: Callable[[], bool] = lambda: False):
        self._ready: set[Key] = set(ready)
        self._busy = busy  # whether the runner is serving now (the thread then compiles only shapes wanted)
        self.wanted: set[Key] = set()  # pending shapes a call fell back from
        self.ahead: set[Key] = set()  # compiled by the thread (their first call compiles nothing)
        self.failed: dict[Key, str] = {}
        self.pending: list[Key] = []
        self.fallbacks = 0  # calls run in a larger shape than their own because it was not ready
        self.compile_seconds = 0.0  # spent by the thread
        self.last_call = time.perf_counter()  # when the runner was last busy (`note_call`)
        self._held = False  # inside `held`: only wanted shapes compile
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def note_call(self) -> None:
        """The runner is busy now (`busy` may measure idle spells from `last_call`)."""
        self.last_call = time.perf_counter()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Compile only wanted shapes inside (a server's setup between warm-up and ready: its first
        calls come at once after it); the runner counts as busy from the moment it leaves."""
        self._held = True
        try:
            yield
        finally:
            self.note_call()
            self._held = False

    def mark_ready(self, key: Key) -> None:
        self._ready.add(key)

    def is_ready(self, key: Key) -> bool:
        return key in self._ready

    def cover(self, kind: str, batch: int, tokens: int, shapes: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
        """The smallest ready (batch, tokens) of `kind` among `shapes` holding `batch` rows of
        `tokens` tokens (fewest padded tokens, then fewest rows); None if none is ready. The
        smallest of all, when not ready, is wanted: the thread compiles it next."""
        fits = sorted((kind, b, t) for b, t in shapes if b >= batch and t >= tokens)
        fits.sort(key=lambda k: k[1] * k[2])
        if fits and fits[0] not in self._ready:
            self.wanted.add(fits[0])
        ready = [k for k in fits if k in self._ready]
        return ready[0][1:] if ready else None

    @property
    def warming(self) -> bool:
        """Whether shapes are still to compile (calls may run padded further, and slower)."""
        return bool(self.pending)

    def start(self, jobs: Sequence[tuple[Key, Callable[[], None]]]) -> None:
        """Compile `jobs` (key, job) in order on a daemon thread; each key is ready once its job returns."""
        self.pending = [key for key, _ in jobs]
        if not jobs:
            return
        self._thread = threading.Thread(target=self._work, args=(list(jobs),), name="jserve-bucket-compiler",
                                        daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _next(self, jobs: list[tuple[Key, Callable[[], None]]]) -> int | None:
        """The index of the job to run now: the first wanted, else (the runner idle) the first; None: wait."""
        wanted = [i for i, (key, _) in enumerate(jobs) if key in self.wanted]
        if wanted:
            return wanted[0]
        return None if self._held or self._busy() else 0

    def _work(self, jobs: list[tuple[Key, Callable[[], None]]]) -> None:
        t0 = time.perf_counter()
        while jobs:
            if self._stop.is_set():
                return
            i = self._next(jobs)
            if i is None:
                self._stop.wait(POLL_S)
                continue
            key, job = jobs.pop(i)
            start = time.perf_counter()
            try:
                job()
            except Exception as e:  # a shape that fails to compile stays missing: its calls keep falling back
                logger.exception("compiling bucket %s in the background failed", key)
                self.failed[key] = f"{type(e).__name__}: {e}"
            else:
                self.ahead.add(key)
                self._ready.add(key)
            finally:
                self.wanted.discard(key)
                self.pending.remove(key)
                self.compile_seconds += time.perf_counter() - start
        logger.info("lazy buckets: %d shapes compiled in the background in %.1f s", len(self.ahead),
                    time.perf_counter() - t0)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every job has run; whether they all have."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running

    def stop(self, timeout: float | None = 60.0) -> None:
        """Start no further job; wait for the one compiling (JAX must not be torn down under it)."""
        self._stop.set()
        self.wait(timeout)

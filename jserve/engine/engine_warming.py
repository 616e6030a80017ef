"""What the server reads and holds of an `AsyncLLMEngine`'s lazy buckets (`jserve.runtime.lazy_buckets`):
how many shapes are still compiling in the background, and the hold through its setup before ready."""

from __future__ import annotations

import contextlib
from typing import Any


class EngineWarming:
    """A mixin over `self.engine` (an `LLMEngine`, or a stand-in without a runner: nothing compiles)."""

    engine: Any

    @property
    def buckets_pending(self) -> int:
        """Shapes the lazy buckets' thread has still to compile (a plain read: any thread)."""
        lazy = self._lazy_buckets()
        return len(lazy.pending) if lazy is not None else 0

    def lazy_buckets_held(self) -> contextlib.AbstractContextManager:
        """Inside, the lazy buckets' thread compiles only shapes a call fell back from, and the
        runner counts as busy from the moment it leaves (`BucketCompiler.held`): a server's setup
        before it says ready, whose first calls come at once after."""
        lazy = self._lazy_buckets()
        return contextlib.nullcontext() if lazy is None else lazy.held()

    def _lazy_buckets(self):
        return getattr(getattr(self.engine, "runner", None), "lazy", None)

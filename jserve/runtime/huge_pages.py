"""Back the CPU runner's weights and KV pages with transparent huge pages (Linux).

The decode step streams every weight and reads K/V in page-sized chunks scattered over the pool;
with 4 KiB memory pages every chunk needs its own TLB entry and the hardware prefetcher stops at
each 4 KiB boundary, so huge pages shorten the step (docs/performance.md, "Kernels"). `advise`
asks for them (`MADV_HUGEPAGE`, then `MADV_COLLAPSE`); `Advice` does it on a background thread,
since collapsing copies every page. Both are advice: where they fail the memory stays as it was.
`JSERVE_HUGE_PAGES=0` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import jax

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def supported() -> bool:
    """Linux with transparent huge pages not set to `never`, and JSERVE_HUGE_PAGES not 0."""
    if not sys.platform.startswith("linux") or os.environ.get("JSERVE_HUGE_PAGES", "1") == "0":
        return False
    try:
        return "[never]" not in _THP_SETTING.read_text()
    except OSError:
        return False


def advise(tree: Any) -> int:
    """Ask for huge pages under every CPU array of `tree` of at least 1 MiB.

    Returns the bytes that `MADV_COLLAPSE` turned into huge pages (0 where unsupported).

    How: `madvise(MADV_HUGEPAGE)` on the 2 MiB-aligned range around each buffer, then
    `MADV_COLLAPSE` (Linux 6.1+), which rebuilds the pages already there as huge pages at once
    (khugepaged would take minutes). Both are advice: they never change the contents, and where they
    fail (another OS, an older kernel, huge pages off, no free 2 MiB of physical memory) the memory
    stays as it was. XLA keeps a donated buffer's address from step to step (the KV pages are updated
    in place), so the advice outlives the steps.
    """
    return _advise(list(_buffers(tree)) if supported() else [])


def _advise(buffers: list[tuple[int, int]], stop: threading.Event | None = None) -> int:
    """`advise` over (address, bytes) ranges; `stop`: when set, the rest are left alone."""
    if not buffers:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done, failed = 0, 0
    for ptr, nbytes in buffers:
        if stop is not None and stop.is_set():
            return done
        # The 2 MiB pages around the buffer (small buffers share them with their neighbours); if
        # some of that is not mapped (a buffer of its own mapping), the whole pages inside it.
        outward = (ptr // HUGE_PAGE * HUGE_PAGE, -(-(ptr + nbytes) // HUGE_PAGE) * HUGE_PAGE)
        inward = (-(-ptr // HUGE_PAGE) * HUGE_PAGE, (ptr + nbytes) // HUGE_PAGE * HUGE_PAGE)
        for start, end in (outward, inward):
            if end > start:
                libc.madvise(start, end - start, _MADV_HUGEPAGE)
                if libc.madvise(start, end - start, _MADV_COLLAPSE) == 0:
                    done += end - start
                    break
        else:
            failed += 1
    if failed:
        logger.info("huge pages: %d buffers stayed on small pages (errno %d)", failed, ctypes.get_errno())
    return done


class Advice:
    """`advise(tree)` running on a daemon thread; `wait()` returns its result, `stop()` ends it
    after the buffer at hand (its owner closing: the thread must not outlive it, nor log after).

    The buffers' addresses are taken now: a donated array is deleted by the step that reuses
    its buffer (same address, see above), so the thread never touches the arrays themselves.

    Collapsing copies every page, slowly (seconds for SmolLM2's weights and the default 512 MiB
    pool), hence the background thread, beside the warm-up's compilations; the kernel keeps the pages
    consistent while steps use them (khugepaged collapses live processes' memory the same way).
    """

    def __init__(self, tree: Any):
        self._bytes = 0
        self._stop = threading.Event()
        buffers = list(_buffers(tree)) if supported() else []
        self._thread = threading.Thread(target=self._run, args=(buffers,), name="jserve-huge-pages",
                                        daemon=True)
        self._thread.start()

    def _run(self, buffers: list[tuple[int, int]]) -> None:
        self._bytes = _advise(buffers, self._stop)

    def wait(self, timeout: float | None = None) -> int:
        """Bytes turned into huge pages (0 while the thread still runs after `timeout`)."""
        self._thread.join(timeout)
        return self._bytes

    def stop(self) -> None:
        """Leave the buffers not yet advised alone and wait for the thread (one `madvise` at most)."""
        self._stop.set()
        self._thread.join()


def _buffers(tree: Any):
    """(address, bytes) of each single-device CPU array's buffer of at least 1 MiB."""
    for x in jax.tree.leaves(tree):
        if not isinstance(x, jax.Array) or x.nbytes < HUGE_PAGE // 2:
            continue
        try:
            devices = x.devices()
            if len(devices) == 1 and next(iter(devices)).platform == "cpu":
                yield x.unsafe_buffer_pointer(), x.nbytes
        except RuntimeError:  # a deleted (donated) array: leave it alone
            continue

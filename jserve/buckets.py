"""The one place that lists the padded shapes of compiled steps and picks one for a request."""

from __future__ import annotations

import bisect
from typing import Sequence

DEFAULT_BATCH_BUCKETS = (2, 4, 8, 16, 32, 64)  # 2, not 1, is the smallest (DESIGN.md §6)
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_LENGTH_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def pick(buckets: Sequence[int], n: int) -> int:
    """The smallest bucket >= n; ValueError if n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def clip(buckets: Sequence[int], limit: int) -> tuple[int, ...]:
    """Buckets up to `limit`, with `limit` itself appended if it falls between two buckets."""
    out = [b for b in buckets if b < limit]
    return tuple(out + [limit])

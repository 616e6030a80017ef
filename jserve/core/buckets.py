"""The one place that lists the padded shapes of compiled steps and picks one for a request."""

from __future__ import annotations

import bisect
from typing import Sequence

# Batch 1 has its own bucket: one row's matmuls are matrix-vector products, which XLA:CPU runs
# near memory bandwidth, so a row of its own beats one row padded to 2. The paged step writes its
# pages in place (they are donated), so a one-row step does not grow with the pool. A backend
# without the native attention kernel drops batch 1 (`Backend.batch_buckets`: batch 2 serves it).
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# A mixed call (prefill chunks, with decode rows) costs about its padded tokens: from 32 to 128,
# steps of at most 1.5x rather than 2x cap what a short prompt, or a few arriving together, pay
# for padding (the time to their first token), at ten more compiled shapes: for lazy buckets
# (`jserve serve`), which compile them behind the served requests, not for a warm-up that waits.
FINE_TOKEN_BUCKETS = (16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """The powers of two below `max_num_seqs`, then `max_num_seqs` itself."""
    return clip([2**i for i in range(max_num_seqs.bit_length())], max_num_seqs)


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

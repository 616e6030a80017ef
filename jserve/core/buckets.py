"""The one place that lists the padded shapes of compiled steps and picks one for a request."""

from __future__ import annotations

import bisect
from typing import Sequence

# Batch 1 has its own bucket: one row's matmuls are matrix-vector products, which XLA:CPU runs
# near memory bandwidth (SmolLM2 decode at 256 context: 35 ms at batch 1 vs 51 ms for one row
# padded to 2; scripts/bench_decode_step.py --batch 1 2). DESIGN.md §6 saw a one-row scatter copy
# the whole cache; the paged step's HLO still has a copy of each layer's pool, but it is done in
# place (the pages are donated): batch-1 step time did not grow with a 6x larger pool (31 ms).
# The runner drops it without the native CPU kernel (the Pallas interpret kernel took 1.5 s at
# batch 1), and the dense-cache runner keeps 2 as its smallest (DESIGN.md §6).
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DENSE_BATCH_BUCKETS = DEFAULT_BATCH_BUCKETS[1:]
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

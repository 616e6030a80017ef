"""The grammar bitmasks a step's sampler takes (structured outputs), for the runner.

One int32 `[batch, ceil(vocab / 32)]` mask per call: the constrained rows' allowed tokens, filled
on the host by `jserve.structured.grammar.fill_bitmasks` (the runner asks after dispatching the
forward, so the fill runs while the device computes), and every bit set elsewhere. A call with
no constrained row gets a cached all-ones mask already on the device. Placed as the runner
places its other inputs (`put`), so a served mask and the warm-up's share one compiled signature.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Sequence

import numpy as np

from jserve.structured.grammar import bitmask_width, fill_bitmasks, fill_bitmasks_with_drafts


class StepMasks:
    """Builds the steps' masks and keeps their host time, for metrics."""

    def __init__(self, vocab_size: int, put: Callable[[np.ndarray], Any]):
        self.width = bitmask_width(vocab_size)
        self._put = put  # a host array -> the device, committed / sharded as the step's inputs
        self._free: dict[int, Any] = {}  # batch -> the all-ones mask, on the device
        self._recent: collections.deque[float] = collections.deque(maxlen=64)  # host seconds per fill
        self.seconds = 0.0  # host time filling masks, in total
        self.num_filled = 0  # calls that filled one

    def device(self, B: int, constraints: Sequence[tuple[Any, int]]) -> Any:
        """The call's mask on the device: its rows' grammars', or the cached all-ones one."""
        if not constraints:
            if B not in self._free:
                self._free[B] = self._put(self.ones(B))
            return self._free[B]
        return self._put(self.host(B, constraints))

    def device_drafts(self, B: int, constraints: Sequence[tuple[Any, int, Sequence[int]]]) -> Any:
        """A verify step's mask: `(matcher, first row, drafts)` per constrained sequence fills
        rows `first .. first + len(drafts)`, its grammar after each prefix of its drafts."""
        if not constraints:
            return self.device(B, ())
        mask = self.ones(B)
        t0 = time.perf_counter()
        fill_bitmasks_with_drafts(constraints, mask)
        self._took(time.perf_counter() - t0)
        return self._put(mask)

    def host(self, B: int, constraints: Sequence[tuple[Any, int]]) -> np.ndarray:
        """The mask filled on the host: `(matcher, batch row)` per constrained row."""
        mask = self.ones(B)
        t0 = time.perf_counter()
        fill_bitmasks(constraints, mask)
        self._took(time.perf_counter() - t0)
        return mask

    def _took(self, seconds: float) -> None:
        self.seconds += seconds
        self.num_filled += 1
        self._recent.append(seconds)

    def ones(self, B: int) -> np.ndarray:
        return np.full((B, self.width), -1, np.int32)

    def stats(self) -> dict[str, float]:
        recent = list(self._recent)
        return {"mask_seconds": self.seconds, "mask_steps": self.num_filled,
                "mask_seconds_per_step": sum(recent) / len(recent) if recent else 0.0}

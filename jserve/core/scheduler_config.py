"""The scheduler's settings (`SchedulerConfig`, validated on construction) and the arithmetic of
recomputing past a length (`tokens_before_recompute`); `jserve.core.scheduler` re-exports both."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16  # running sequences cap
    max_num_batched_tokens: int = 512  # tokens computed per step (decode tokens + prefill chunks)
    max_model_len: int = 2048  # prompt + output tokens of one request
    enable_prefix_caching: bool = False
    num_scheduler_steps: int = 1  # decode steps per device call when only decodes run (vLLM's name)
    recompute_past: int | None = None  # see the module's notes (None: never)

    def __post_init__(self):
        for name, minimum in (("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("max_model_len", 2),
                              ("num_scheduler_steps", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_num_seqs={self.max_num_seqs} (every running sequence takes a "
                             "token each step)")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.recompute_past is not None and (not isinstance(self.recompute_past, int)
                                                or isinstance(self.recompute_past, bool) or self.recompute_past < 1):
            raise ValueError(f"recompute_past must be a positive integer or None, got {self.recompute_past!r}")


def tokens_before_recompute(num_tokens: int, recompute_past: int | None) -> int | None:
    """The most tokens a request of `num_tokens` tokens may sample in one device call so that it
    computes no position past `recompute_past` (its last sample may take it to recompute_past + 1,
    and the recompute follows the call); None: no limit."""
    if recompute_past is None or num_tokens > recompute_past:
        return None
    return recompute_past + 1 - num_tokens

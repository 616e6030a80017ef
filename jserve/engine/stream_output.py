"""What a request's stream yields: output deltas (with stop-string hold-back) and its timings.

Pure Python, used by `jserve.engine.async_engine` on the consumer side and by the server's metrics.
"""

from __future__ import annotations

import dataclasses

from jserve.core.request import CompletionOutput, RequestOutput, SamplingParams
from jserve.core.stop import holdback


@dataclasses.dataclass(frozen=True)
class RequestTimings:
    """Monotonic (`time.monotonic()`) timestamps of one request, for the metrics."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int  # over all n samples
    num_cached_tokens: int  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int
    finish_reason: str | None  # of the first sample; None while running

    @property
    def queue_time(self) -> float | None:
        return _diff(self.first_scheduled_time, self.arrival_time)

    @property
    def prefill_time(self) -> float | None:
        return _diff(self.first_token_time, self.first_scheduled_time)

    @property
    def decode_time(self) -> float | None:
        return _diff(self.finished_time, self.first_token_time)

    @property
    def e2e_time(self) -> float | None:
        return _diff(self.finished_time, self.arrival_time)


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start



class Tracker:
    """Turns a request's cumulative outputs into what its stream yields (deltas or snapshots)."""

    def __init__(self, params: SamplingParams, delta: bool):
        self.delta = delta
        self.holdback = holdback(params)  # what a stop string could still cut
        self.sent: dict[int, tuple[int, int, bool]] = {}  # completion index -> (chars, tokens, finished)
        self.first = True

    def next(self, out: RequestOutput) -> RequestOutput | None:
        completions = []
        for c in out.outputs:
            num_chars, num_tokens, done = self.sent.get(c.index, (0, 0, False))
            if done and self.delta:
                continue  # its finish was reported
            end = len(c.text) if c.finished else max(num_chars, len(c.text) - self.holdback)
            n = len(c.token_ids)
            changed = (c.finished and not done) or end > num_chars or n > num_tokens
            self.sent[c.index] = (end, n, c.finished)
            if self.delta and not changed:
                continue
            lo_c, lo_t = (num_chars, num_tokens) if self.delta else (0, 0)
            logprobs = None if c.logprobs is None else c.logprobs[lo_t:n]  # the list grows on the engine thread
            completions.append(CompletionOutput(c.index, c.text[lo_c:end], list(c.token_ids[lo_t:n]), logprobs,
                                                c.finish_reason, c.stop_reason))
        if self.delta and not completions and not out.finished:
            return None
        prompt_logprobs = out.prompt_logprobs if self.first or not self.delta else None
        self.first = False
        return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, completions, prompt_logprobs,
                             out.finished)

"""What `AsyncLLMEngine` keeps of its requests for the server's metrics: each request's
`RequestTimings` (the last `max_timings` requests', readable from any thread) and the monotone
totals (finished samples by finish reason; prompt tokens once a request's prefill is done and
generated tokens as they come, as vLLM counts them per step), which its `stats()` reports.
Pure Python; the threading model is `jserve.engine.async_engine`'s."""

from __future__ import annotations

import collections
import threading
from typing import Any

from jserve.core.request import RequestOutput
from jserve.engine.stream_output import RequestTimings


class RequestLedger:
    """Timings are written on the engine thread and read from any; the totals are the engine
    thread's alone."""

    def __init__(self, max_timings: int):
        self._timings: collections.OrderedDict[str, RequestTimings] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._max_timings = max_timings
        self._finished: collections.Counter[str] = collections.Counter()
        self._tokens = collections.Counter(prompt=0, generation=0)
        self._generated: dict[str, int] = {}  # request id -> generated tokens already counted

    def timings(self, request_id: str) -> RequestTimings | None:
        with self._lock:
            return self._timings.get(request_id)

    def record(self, request_id: str, requests: list, out: RequestOutput) -> None:
        """Store the request's timings as of `out`, from the scheduler's Request objects of its
        samples (nothing without them); the oldest request's go past `max_timings`."""
        if not requests:
            return
        timings = _timings_of(requests, out)
        with self._lock:
            self._timings[request_id] = timings
            self._timings.move_to_end(request_id)
            while len(self._timings) > self._max_timings:
                self._timings.popitem(last=False)

    def count(self, out: RequestOutput, first: bool) -> None:
        """Add an engine output (cumulative, as `LLMEngine.step` returns them) to the totals:
        `first`, the request's first output, counts its prompt; its new tokens; at its end, its
        samples' finish reasons."""
        if first:
            self._tokens["prompt"] += len(out.prompt_token_ids or ())
        generated = sum(len(c.token_ids) for c in out.outputs)
        self._tokens["generation"] += generated - self._generated.pop(out.request_id, 0)
        if out.finished:
            self._finished.update(c.finish_reason or "abort" for c in out.outputs)
        else:
            self._generated[out.request_id] = generated

    def totals(self) -> dict[str, Any]:
        """`finished_requests` (by finish reason), `prompt_tokens` and `generation_tokens`."""
        return {"finished_requests": dict(self._finished), **{f"{k}_tokens": v for k, v in self._tokens.items()}}


def _timings_of(reqs: list, out: RequestOutput) -> RequestTimings:
    def first(name):
        values = [getattr(r, name) for r in reqs if getattr(r, name) is not None]
        return min(values) if values else None

    finished = [r.finished_time for r in reqs]
    return RequestTimings(
        arrival_time=reqs[0].arrival_time, first_scheduled_time=first("first_scheduled_time"),
        first_token_time=first("first_token_time"),
        finished_time=max(finished) if None not in finished else None,
        num_prompt_tokens=len(reqs[0].prompt_token_ids),
        num_output_tokens=sum(len(r.output_token_ids) for r in reqs),
        num_cached_tokens=reqs[0].num_cached_tokens, num_preemptions=sum(r.num_preemptions for r in reqs),
        finish_reason=out.outputs[0].finish_reason if out.outputs else None)


def requests_of(engine: Any, request_id: str, n: int) -> list:
    """The scheduler's Request objects of a just-added request (LLMEngine names samples `id#i`)."""
    get = getattr(getattr(engine, "scheduler", None), "get_request", None)
    if get is None:
        return []
    names = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
    return [r for r in map(get, names) if r is not None]

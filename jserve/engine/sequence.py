"""The engine's request table entries: a sampled sequence is the scheduler's `Request` itself
with its text state (`SequenceState`), one of the n samples of a user request (`SampleGroup`).
So there is one table of requests, the scheduler's; the engine keeps the user requests only."""

from __future__ import annotations

import dataclasses
from typing import Any

from jserve.core.plan import Request, ScheduledChunk
from jserve.core.request import CompletionOutput, Logprob, RequestOutput, SamplingParams


@dataclasses.dataclass(eq=False)
class SequenceState(Request):
    """One sampled sequence: the scheduler's request, with its detokenizer, text and logprobs."""

    group: SampleGroup | None = None
    index: int = 0  # its sample index within the group
    detok: Any = None
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0

    @property
    def stop_reason(self) -> int | str | None:
        return None if self.stop is None else self.stop.stop_reason

    def prompt_targets(self, chunk: ScheduledChunk) -> list[int] | None:
        """For a chunk of the sample that scores its request's prompt, while positions of it are
        unscored: the token after each of the chunk's positions (-1 past the prompt)."""
        group = self.group
        if self.index != 0 or group is None or group.prompt_logprobs is None:
            return None
        prompt = group.prompt_token_ids
        scored = len(group.prompt_logprobs)
        if scored >= len(prompt) or chunk.start + chunk.num_tokens < scored:
            return None
        end = chunk.start + chunk.num_tokens
        return [prompt[q + 1] if q + 1 < len(prompt) else -1 for q in range(chunk.start, end)]


@dataclasses.dataclass(eq=False)
class SampleGroup:
    """A user request: its n sampled sequences, gathered into one `RequestOutput`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState] = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None

    def output(self) -> RequestOutput:
        params = self.params
        finished = all(s.is_finished for s in self.sequences)
        chosen = [(s.index, s) for s in self.sequences]
        if params.num_samples > params.n:  # best_of: nothing until all are done, then the n best
            chosen = list(enumerate(sorted(self.sequences, key=lambda s: -s.cumulative_logprob)[:params.n]
                                    if finished else []))
        if params.max_tokens == 0:  # its sequences' one sample is hidden (LLMEngine.add_request)
            outs = [CompletionOutput(i, "", [], None if s.logprobs is None else [],
                                     s.status.finish_reason if s.status.finish_reason in (None, "abort") else "length")
                    for i, s in chosen]
        else:
            outs = [CompletionOutput(i, s.text, list(s.output_token_ids),
                                     None if s.logprobs is None else list(s.logprobs),
                                     s.status.finish_reason, s.stop_reason) for i, s in chosen]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.prompt_logprobs,
                             finished=finished)

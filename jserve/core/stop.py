"""When a sequence ends: the one stop policy for the host, the device and the stream.

Rules, in vLLM's order: a sampled EOS (unless `ignore_eos`) or stop token id, or a completed
stop string, ends the sequence once it has `min_tokens` tokens ("stop"); `max_tokens` tokens, or
the context length, end it ("length"). The engine checks each new token on the host
(`StopPolicy.check`); a multi-step decode checks the ids on the device too
(`StopPolicy.device_stops`), to spare the steps after a stop; the scheduler plans those steps
within `tokens_left`; a stream holds back what a stop string could still cut (`holdback`).
Pure Python.
"""

from __future__ import annotations

import dataclasses
from typing import AbstractSet

from jserve.core.request import SamplingParams

MAX_DEVICE_STOP_IDS = 16  # stop ids per row a multi-step decode checks on the device (the host checks all)


@dataclasses.dataclass(frozen=True)
class Stop:
    """A sequence's end: `finish_reason` "stop" or "length", the stop string or token id that
    ended it (`stop_reason`, None for EOS and lengths), and its text with a stop string cut."""

    finish_reason: str
    stop_reason: int | str | None = None
    text: str | None = None
    # max_tokens or a completed grammar: a stop string the same token completes ends the sequence
    # instead (vLLM's order: EOS, stop ids, stop strings, max_tokens).
    weak: bool = False

    @property
    def status_name(self) -> str:
        """The `RequestStatus` member it ends a request with."""
        return "FINISHED_STOPPED" if self.finish_reason == "stop" else "FINISHED_LENGTH"


def tokens_left(params: SamplingParams, num_output: int, num_tokens: int, max_len: int) -> int:
    """Tokens the sequence may still sample before `max_tokens` or the context length ends it."""
    left = max_len - num_tokens
    if params.max_tokens is not None:
        left = min(left, params.max_tokens - num_output)
    return max(left, 0)


def holdback(params: SamplingParams) -> int:
    """Characters a stream holds back: a stop string is cut from the text when it completes,
    possibly reaching back into text of earlier steps (as vLLM does)."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(map(len, params.stop)) - 1


@dataclasses.dataclass(frozen=True)
class StopPolicy:
    """The stop rules of one model: its EOS ids and vocabulary."""

    eos_token_ids: AbstractSet[int]
    vocab_size: int

    def validate(self, params: SamplingParams) -> None:
        """ValueError naming a stop token id outside the vocabulary."""
        for token in params.stop_token_ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"stop_token_ids: {token} is outside the vocabulary [0, {self.vocab_size})")

    def stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """The ids that end the sequence: the request's, then EOS unless ignored."""
        eos = [] if params.ignore_eos else sorted(self.eos_token_ids)
        return tuple(dict.fromkeys([*params.stop_token_ids, *eos]))

    def device_stops(self, params: SamplingParams, num_output: int) -> tuple[tuple[int, ...], int]:
        """What a multi-step decode checks on the device: the first MAX_DEVICE_STOP_IDS stop ids,
        and how many samples must come before one counts (`min_tokens` counted down)."""
        return self.stop_ids(params)[:MAX_DEVICE_STOP_IDS], max(0, params.min_tokens - num_output)

    def check_token(self, params: SamplingParams, token: int, num_output: int) -> Stop | None:
        """The token-level stop at the sequence's newest `token`, its `num_output`-th (the
        scheduler's update): EOS, a stop id, or `max_tokens` (weak: a stop string comes first)."""
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return Stop("stop")
            if token in params.stop_token_ids:
                return Stop("stop", token)
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return Stop("length", weak=True)
        return None

    @staticmethod
    def check_text(params: SamplingParams, num_output: int, text: str, new_text_from: int) -> Stop | None:
        """A stop string completed by the newest token; `text` is the whole text so far, of which
        `[new_text_from:]` came with it (a stop string is looked for only where it could end)."""
        if num_output < params.min_tokens:
            return None
        for s in params.stop:
            at = text.find(s, max(0, new_text_from - len(s) + 1))
            if at >= 0:
                return Stop("stop", s, text[:at + (len(s) if params.include_stop_str_in_output else 0)])
        return None

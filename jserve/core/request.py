"""Requests and their results: SamplingParams, RequestOutput, CompletionOutput (pure Python).

The shapes follow vLLM's so that its users feel at home: `llm.generate(prompts, params)` returns
one `RequestOutput` per prompt whose `outputs[0]` holds the generated tokens and text.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

MAX_LOGPROBS = 20  # the most top-k logprobs a request may ask for (a static shape in the step)
# the most distinct tokens a request's logit_bias and allowed_token_ids may name together (a static
# shape in the step: docs/architecture.md, "The step contract")
MAX_LOGIT_ENTRIES = 128


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate, named as vLLM names it: exactly one of

    - `json`: a JSON schema (a dict, or its JSON text) the output must validate against;
    - `json_object`: True for any JSON object (OpenAI's `{"type": "json_object"}`);
    - `regex`: a regular expression the whole output must match;
    - `choice`: the output is exactly one of these strings;
    - `grammar`: a context-free grammar in Lark syntax or llama.cpp's GBNF.

    `disable_any_whitespace` (default True) makes JSON compact, with ", " and ": " separators and
    no other whitespace: small models otherwise fill the output with spaces and newlines; set it
    False for JSON whose whitespace is free. The grammar library (`jserve.structured`) compiles it
    into a token mask per step; the output ends when the constraint is complete. `reasoning`: a
    reasoning model's free `<think>` ... `</think>` comes first, the constraint after it.
    `close_at_limit`: near `max_tokens` (or the context's end), only tokens that let the output
    complete within it are allowed (`jserve.structured.closing`); None: the engine's default (off
    unless the server says so).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True
    reasoning: bool = False
    close_at_limit: bool | None = None

    def __post_init__(self):
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_CONSTRAINTS)}, got "
                             f"{', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), got "
                             f"{type(self.json).__name__}")
        if self.close_at_limit is not None and not isinstance(self.close_at_limit, bool):
            raise ValueError(f"structured_outputs.close_at_limit must be a boolean, got {self.close_at_limit!r:.60}")
        if self.json_object is not True and self.json_object is not False:
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if not isinstance(self.choice, (str, list, tuple)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                                 f"{type(self.choice).__name__}")
            choice = [self.choice] if isinstance(self.choice, str) else list(self.choice)
            if not choice or any(not isinstance(c, str) or not c for c in choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                                 f"{self.choice!r:.80}")
            object.__setattr__(self, "choice", tuple(choice))

    @property
    def kind(self) -> str:
        """Which constraint it is: json, json_object, regex, choice or grammar."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


_CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `temperature=0` is greedy decoding."""

    n: int = 1
    best_of: int | None = None  # samples drawn, of which the n of highest cumulative logprob are returned
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output so far
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of tokens already generated
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length; 0: none (scoring the prompt)
    min_tokens: int = 0
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs of each generated token
    prompt_logprobs: int | None = None  # top-k logprobs at each prompt position
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # A grammar the output must follow (JSON schema, regex, choice, grammar); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: Sequence[int] | None = None  # only these tokens may be sampled
    # words never generated (`jserve.core.bad_words`); their token sequences are filled from the
    # tokenizer when the engine takes the request (or given here)
    bad_words: Sequence[str] | None = None
    bad_words_token_ids: Sequence[Sequence[int]] | None = None

    def __post_init__(self):
        def check(cond: bool, name: str, rule: str):
            if not cond:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(self.best_of is None or (isinstance(self.best_of, int) and self.best_of >= self.n), "best_of",
              f"must be an integer >= n ({self.n}) or None")
        check(self.best_of in (None, self.n) or self.max_tokens != 0, "best_of",
              "ranks samples, and max_tokens 0 samples none")
        check(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 or a positive integer")
        check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10, "repetition_penalty",
              "must be in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            check(_finite(getattr(self, name)) and -2 <= getattr(self, name) <= 2, name, "must be in [-2, 2]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer or None")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
                                          and self.max_tokens >= 0), "max_tokens", "must be an integer >= 0 or None")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS), name,
                  f"must be an integer in [0, {MAX_LOGPROBS}] or None")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = list(self.stop_token_ids or ())
        if any(not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, got "
                             f"{type(self.structured_outputs).__name__}")
        object.__setattr__(self, "_logit_entries", _logit_entries(self.logit_bias, self.allowed_token_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        _check_bad_words(self)

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError naming the first id of `logit_bias` / `allowed_token_ids` outside the
        vocabulary (the step would drop it silently)."""
        for t in self.logit_entries[0] + tuple(self.logit_bias or ()):
            if t >= vocab_size:
                raise ValueError(f"token id {t} in logit_bias or allowed_token_ids is outside the vocabulary "
                                 f"[0, {vocab_size})")
        for t in (t for seq in self.bad_words_token_ids or () for t in seq):
            if t >= vocab_size:
                raise ValueError(f"token id {t} of bad_words is outside the vocabulary [0, {vocab_size})")

    @property
    def logit_entries(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The step's sparse form of `logit_bias` and `allowed_token_ids` (`jserve.runtime.sampler`):
        the listed token ids and what each adds to its logit (every allowed token is listed)."""
        return self._logit_entries

    @property
    def bans_depend_on_output(self) -> bool:
        """A bad word of several tokens: each step's bans depend on the tokens sampled before it,
        so the step needs them on the host (no multi-step decode, no fed or drafted tokens)."""
        return any(len(seq) > 1 for seq in self.bad_words_token_ids or ())

    @property
    def num_samples(self) -> int:
        """Sequences the request runs: best_of, else n."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _logit_entries(bias, allowed) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """`SamplingParams.logit_entries` from its fields, checked."""
    if bias is not None and not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    for t, v in (bias or {}).items():
        if not _token_id(t):
            raise ValueError(f"logit_bias keys must be non-negative integer token ids, got {t!r}")
        if not _finite(v) or not -100 <= v <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for token {t}")
    if allowed is not None:
        if isinstance(allowed, (str, bytes, dict)) or not hasattr(allowed, "__iter__"):
            raise ValueError(f"allowed_token_ids must be a list of token ids, got {allowed!r:.80}")
        allowed = list(allowed)
        if not allowed or any(not _token_id(t) for t in allowed):
            raise ValueError(f"allowed_token_ids must be a non-empty list of non-negative integer token ids, "
                             f"got {allowed!r:.80}")
    entries = dict.fromkeys(allowed if allowed is not None else (), 0.0)
    # a biased token outside allowed_token_ids is banned anyway
    entries.update((t, float(v)) for t, v in (bias or {}).items() if allowed is None or t in entries)
    if len(entries) > MAX_LOGIT_ENTRIES:
        raise ValueError(f"logit_bias and allowed_token_ids may name at most {MAX_LOGIT_ENTRIES} distinct tokens "
                         f"together, got {len(entries)}")
    return tuple(entries), tuple(entries.values())


def _check_bad_words(p: SamplingParams) -> None:
    """`bad_words` and their token sequences, checked and made tuples; each sequence bans at most
    one token a step, beside the logit entries, within MAX_LOGIT_ENTRIES."""
    words = p.bad_words
    if words is not None:
        if isinstance(words, (str, bytes)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(f"bad_words must be a list of words (strings that are not blank), got {words!r:.80}")
        object.__setattr__(p, "bad_words", tuple(words))
    seqs = p.bad_words_token_ids
    if seqs is None:
        return
    seqs = tuple(tuple(s) for s in seqs)
    if any(not s or not all(_token_id(t) for t in s) for s in seqs):
        raise ValueError(f"bad_words_token_ids must be non-empty sequences of token ids, got {seqs!r:.80}")
    room = MAX_LOGIT_ENTRIES - len(p.logit_entries[0])
    if len(seqs) > room:
        raise ValueError(f"bad_words make {len(seqs)} token sequences, but at most {room} fit beside the logit_bias "
                         f"and allowed_token_ids entries ({MAX_LOGIT_ENTRIES} in all)")
    object.__setattr__(p, "bad_words_token_ids", seqs)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


GREEDY = SamplingParams(temperature=0.0)  # what padded rows and plain argmax decoding use


# A position's logprobs: {token_id: Logprob}, the sampled (or prompt) token always included.
@dataclasses.dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # first position: None
    finished: bool = False

"""The token-level sampling controls of a request body: OpenAI's `logit_bias` and vLLM's
`allowed_token_ids` and `bad_words`, read and checked against the vocabulary (400s naming the bad value); the
step applies them as sparse entries (`jserve.runtime.sampler`, docs/architecture.md)."""

from __future__ import annotations

import math
import reprlib
from typing import Any

from jserve.core.request import MAX_LOGIT_ENTRIES
from jserve.server.errors import bad_request

_REPR = reprlib.Repr(maxstring=60, maxother=60)


def _token(value: Any, vocab_size: int, where: str) -> int:
    """A token id in the vocabulary, or a 400 naming `value`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{where} must hold integer token ids, got {_REPR.repr(value)}", param=where)
    if not 0 <= value < vocab_size:
        raise bad_request(f"token id {value} in {where} is outside the vocabulary [0, {vocab_size})", param=where)
    return value


def logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """`logit_bias`: {token id as a string: bias in [-100, 100]} (OpenAI's form; integer keys too)."""
    bias = body.get("logit_bias")
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise bad_request(f"logit_bias must be an object of token id -> bias, got {_REPR.repr(bias)}",
                          param="logit_bias")
    if len(bias) > MAX_LOGIT_ENTRIES:
        raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_ENTRIES} tokens, got {len(bias)}",
                          param="logit_bias")
    out = {}
    for key, value in bias.items():
        text = str(key).strip()
        if isinstance(key, bool) or not (isinstance(key, int) or text.lstrip("-").isdigit()):
            raise bad_request(f"logit_bias keys must be token ids, got {_REPR.repr(key)}", param="logit_bias")
        token = _token(int(text), vocab_size, "logit_bias")
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or not -100 <= value <= 100):
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {_REPR.repr(value)} for "
                              f"token {token}", param="logit_bias")
        out[token] = float(value)
    return out


def allowed_token_ids(body: dict, vocab_size: int) -> list[int] | None:
    """vLLM's `allowed_token_ids`: a non-empty list of token ids, the only ones sampled."""
    allowed = body.get("allowed_token_ids")
    if allowed is None:
        return None
    if not isinstance(allowed, list) or not allowed or len(allowed) > MAX_LOGIT_ENTRIES:
        raise bad_request(f"allowed_token_ids must be a list of 1 to {MAX_LOGIT_ENTRIES} token ids, got "
                          f"{_REPR.repr(allowed)}", param="allowed_token_ids")
    return [_token(t, vocab_size, "allowed_token_ids") for t in allowed]


def bad_words(body: dict) -> list[str] | None:
    """vLLM's `bad_words`: a list of words never generated (the engine tokenizes them)."""
    words = body.get("bad_words")
    if words is None or words == []:
        return None
    if not isinstance(words, list) or len(words) > MAX_LOGIT_ENTRIES:
        raise bad_request(f"bad_words must be a list of at most {MAX_LOGIT_ENTRIES} words, got {_REPR.repr(words)}",
                          param="bad_words")
    for w in words:
        if not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS:
            raise bad_request(f"each of bad_words must be a word of 1 to {MAX_BAD_WORD_CHARS} characters that is not "
                              f"blank, got {_REPR.repr(w)}", param="bad_words")
    return list(words)


MAX_BAD_WORD_CHARS = 256


def read(body: dict, vocab_size: int) -> dict[str, Any]:
    """The SamplingParams keywords of the body's token-level controls."""
    return dict(logit_bias=logit_bias(body, vocab_size), allowed_token_ids=allowed_token_ids(body, vocab_size),
                bad_words=bad_words(body))

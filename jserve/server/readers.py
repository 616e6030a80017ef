"""Reading one field of a client's JSON body: each error a 400 naming the field and its value."""

from __future__ import annotations

import math
import reprlib
from typing import Any

from jserve.server.errors import APIError, bad_request

# repr of a client's value for an error message, never more than a few dozen items deep or wide
_REPR = reprlib.Repr(maxlevel=3, maxlist=8, maxdict=8, maxstring=80, maxother=80, maxlong=80)


def type_error(name: str, want: str, value: Any) -> APIError:
    return bad_request(f"{name} must be {want}, got {show(value)}", param=name)


def show(value: Any) -> str:
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def int_field(body: dict, name: str, default: Any = None, lo: int | None = None, hi: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(name, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_request(f"{name} must be in [{lo}, {hi}], got {show(value)}", param=name)
    return value


def float_field(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise type_error(name, "a finite number", value)
    return float(value)


def bool_field(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise type_error(name, "a boolean", value)
    return value


def str_field(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise type_error(name, "a string", value)
    return value


def token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise bad_request(f"{name} must be a non-empty list of token ids, got {show(value)}", param=name)
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise type_error(name, "a list of integer token ids", t)
        if not 0 <= t < vocab_size:
            raise bad_request(f"token id {t} in {name} is outside the vocabulary [0, {vocab_size})", param=name)
    return list(value)


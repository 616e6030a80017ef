"""A request body, read under a deadline and parsed strictly: the JSON object a route validates.

Strict means: UTF-8 only (invalid bytes, including UTF-8-encoded surrogates, are a 400), no
duplicate keys (a proxy that checks the first of two `model` keys must not be bypassed by the
second), no NaN / Infinity constants, and no lone surrogates from `\\u` escapes (they would
reach the tokenizer and our own replies). Each 400 names where the problem is.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from jserve.server.errors import APIError, bad_request


async def read_json(request: web.Request, timeout: float) -> dict:
    """The body of `request` as a JSON object; 408 if it has not all arrived within `timeout`
    seconds (a client trickling it must not hold the connection), 413 past the size limit."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="body_timeout") from None
    return parse_json(raw)


class _Duplicate(ValueError):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def _constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict:
    """`raw` as a JSON object, or a 400 that says what is wrong and where."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the body is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} "
                          f"({e.reason})") from None
    try:
        body = json.loads(text, object_pairs_hook=_object, parse_constant=_constant)
    except _Duplicate as e:
        key = _short(ascii(str(e))[1:-1])
        raise bad_request(f"the body repeats the key '{key}': each key may appear once per object",
                          param=key, code="duplicate_key") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise bad_request(f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    if "\\u" in text:  # the only way to a lone surrogate once the bytes are strict UTF-8
        where = _surrogate(body, "")
        if where is not None:
            where = _short(where)
            raise bad_request(f"{where} holds a lone surrogate (an unpaired \\u escape): not valid unicode",
                              param=where or None, code="invalid_unicode")
    return body


def _bad_str(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _surrogate(value: Any, path: str) -> str | None:
    """Where in `value` a lone surrogate is (a path like `messages[0].content`), or None."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if _bad_str(item):
                return where or "the body"
        elif isinstance(item, dict):
            for key, sub in item.items():
                if _bad_str(key):
                    return f"a key of {where or 'the body'}"
                stack.append((sub, f"{where}.{key}" if where else key))
        elif isinstance(item, list):
            stack.extend((sub, f"{where}[{i}]") for i, sub in enumerate(item))
    return None


def _short(text: str) -> str:
    return text if len(text) <= 64 else text[:61] + "..."

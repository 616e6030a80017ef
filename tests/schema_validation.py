"""What a structured-output test checks a decoded text with: `SchemaCase` (a schema, a prompt and a
valid example) and `validate` (json.loads, then jsonschema with the formats below).

The schemas themselves are tests/structured_schemas.py.
"""

import dataclasses
import datetime
import json
import re

import jsonschema


@dataclasses.dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict
    prompt: str  # a user message asking for such an object, short and concrete
    bounded: bool = True  # False: some string (or array) has no maxLength (maxItems)
    example: object = None  # one valid instance (its json.dumps is what a constrained decode may emit)


# `jsonschema.FormatChecker()` with no arguments is not what Draft 2020-12 means: it maps "time"
# to draft 3's `%H:%M:%S` (rejecting RFC 3339 offsets and fractions, which llguidance allows),
# and without the optional rfc3339-validator package it checks no "date-time" at all. So start
# from the 2020-12 checker's formats and add strict RFC 3339 (section 5.6) date-time and time.
FORMAT_CHECKER = jsonschema.FormatChecker(formats=list(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers))

_RFC3339_TIME = r"(\d{2}):(\d{2}):(\d{2})(?:\.\d+)?(?:[Zz]|([+-])(\d{2}):(\d{2}))"
_TIME_RE = re.compile(_RFC3339_TIME)
_DATE_TIME_RE = re.compile(r"(\d{4})-(\d{2})-(\d{2})[Tt]" + _RFC3339_TIME)


def bounded_str(max_length: int, **extra) -> dict:
    """A string schema with a maxLength (the suite's bounded cases: tests/structured_schemas.py)."""
    return {"type": "string", "maxLength": max_length, **extra}


def _time_ok(hour: str, minute: str, second: str, sign: str | None, off_h: str | None, off_m: str | None) -> bool:
    if int(hour) > 23 or int(minute) > 59 or int(second) > 60:  # 60: a leap second
        return False
    return sign is None or (int(off_h) <= 23 and int(off_m) <= 59)


@FORMAT_CHECKER.checks("date-time", raises=ValueError)
def _is_date_time(instance: object) -> bool:
    if not isinstance(instance, str):
        return True
    m = _DATE_TIME_RE.fullmatch(instance)
    if m is None:
        return False
    datetime.date(int(m[1]), int(m[2]), int(m[3]))  # raises ValueError on 2025-02-30
    return _time_ok(*m.groups()[3:])


@FORMAT_CHECKER.checks("time")
def _is_time(instance: object) -> bool:
    if not isinstance(instance, str):
        return True
    m = _TIME_RE.fullmatch(instance)
    return m is not None and _time_ok(*m.groups())


def validate(case: SchemaCase, text: str) -> object:
    """Parse `text` as JSON and check it against `case.schema`, formats included.

    Returns the parsed value; raises json.JSONDecodeError or jsonschema.ValidationError."""
    obj = json.loads(text)
    jsonschema.validate(obj, case.schema, format_checker=FORMAT_CHECKER)
    return obj

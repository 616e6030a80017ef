"""Tool calls a grammar forces: OpenAI's `tool_choice` "required" and a named function.

These work with any model, its chat template knowing tools or not, because the output is
constrained (`tool_constraint`) to one of two JSON shapes, which `ForcedToolStream` reads back as
OpenAI tool calls while it streams:

- a named function: the output is that function's arguments object (its `parameters` schema);
- "required": a JSON array of `{"name": <one of the tools>, "parameters": {...}}`, at least one
  (exactly one when `parallel_tool_calls` is false) — vLLM's shape for the same choice.

`tool_choice` "auto" instead lets the model write its own format, read by `tool_parsers`.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from jserve.core.request import StructuredOutputsParams
from jserve.structured.tool_parsers import ToolCall, ToolCallDelta

_ANY_OBJECT = {"type": "object"}


def function_of(tool: dict) -> dict:
    """The `function` of an OpenAI tool (`{"type": "function", "function": {...}}`)."""
    return tool["function"]


def required_schema(tools: Sequence[dict], parallel: bool, args_key: str = "parameters") -> dict:
    """The JSON schema of "required": an array of calls to these tools, each `{"name", args_key}`."""
    calls = [{"type": "object", "properties": {"name": {"const": function_of(t)["name"]},
                                               args_key: function_of(t).get("parameters") or _ANY_OBJECT},
              "required": ["name", args_key], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_constraint(tools: Sequence[dict], choice: str | dict, parallel: bool) -> StructuredOutputsParams | None:
    """The constraint a `tool_choice` puts on the output: None for "none" and "auto"."""
    if choice in ("none", "auto"):
        return None
    if choice == "required":
        return StructuredOutputsParams(json=required_schema(tools, parallel))
    tool = next(t for t in tools if function_of(t)["name"] == choice["function"]["name"])
    return StructuredOutputsParams(json=function_of(tool).get("parameters") or _ANY_OBJECT)


class ForcedToolParser:
    """`tool_parsers.ToolParser`'s interface for a forced choice: `name` the named function, or
    None for "required"."""

    def __init__(self, name: str | None):
        self.name = name

    def stream(self) -> "ForcedToolStream":
        return ForcedToolStream(self.name)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole output at once: (content, calls); content only where no call came out."""
        if self.name is not None:
            if not _is_object(text):
                return text, []  # cut short: the arguments are not a JSON object
            return "", [ToolCall(self.name, text)]
        stream = ForcedToolStream(None)
        stream.feed(text)
        content, _ = stream.finish()
        return content, stream.calls


class ForcedToolStream:
    """Reads the calls of a forced tool choice out of the streamed output (`feed` each new piece,
    then `finish`), with `tool_parsers.ToolCallStream`'s interface: (content, deltas) per piece.

    A named call's arguments stream as they come (its first delta carries the id and name); the
    calls of "required" each go out whole once their array element is complete. Output that is
    not what the grammar forces (cut by `max_tokens` or a stop string) is left as content by
    `finish` when no call came out of it.
    """

    def __init__(self, name: str | None, args_key: str = "parameters"):
        self.name = name  # the named function, or None for "required"
        self.args_key = args_key  # an array element's arguments: "parameters" ("required"), "arguments" (generic)
        self.calls: list[ToolCall] = []
        self._text = ""
        self._pos = 0  # "required": where the next array element starts
        self._opened = False
        self._named_id: str | None = None

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._text += delta
        if self.name is not None:
            if not delta:
                return "", []
            if self._named_id is None:
                self._named_id = ToolCall(self.name, "").id
                return "", [ToolCallDelta(0, self._named_id, self.name, delta)]
            return "", [ToolCallDelta(0, arguments=delta)]
        return "", self._elements()

    def _elements(self) -> list[ToolCallDelta]:
        """The "required" array's elements completed since the last call."""
        deltas: list[ToolCallDelta] = []
        decoder = json.JSONDecoder()
        text = self._text
        while True:
            pos = _skip(text, self._pos, " \t\r\n")
            if not self._opened:
                if pos >= len(text) or text[pos] != "[":
                    return deltas
                self._opened, pos = True, pos + 1
            pos = _skip(text, pos, " \t\r\n,")
            if pos >= len(text) or text[pos] == "]":
                self._pos = pos
                return deltas
            try:
                element, end = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):
                self._pos = pos
                return deltas  # not complete yet
            self._pos = end
            if isinstance(element, dict) and isinstance(element.get("name"), str):
                call = ToolCall(element["name"], json.dumps(element.get(self.args_key, {}), ensure_ascii=False))
                deltas.append(ToolCallDelta(len(self.calls), call.id, call.name, call.arguments))
                self.calls.append(call)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The calls are final: a named call counts only when its arguments are a JSON object (a
        stop string or max_tokens may have cut them; the deltas already sent say what came)."""
        if self.name is not None:
            if self._named_id is not None and _is_object(self._text):
                self.calls = [ToolCall(self.name, self._text, self._named_id)]
            return "", []
        return ("", []) if self.calls else (self._text.strip(), [])


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False

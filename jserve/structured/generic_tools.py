"""Tools with any model: jserve's generic tool-call format, after llama.cpp's generic handler.

Where the chat template shows no tool-call format that jserve reads (no `--tool-call-parser`, none
implied by the template), the tools reach the model as text and its answer is constrained to JSON:

- `generic_messages`: the tools and the answer format go into a system message, merged into the
  conversation's own first one; assistant tool calls and tool results
  already in the conversation become text in the same format, so any template renders them;
- `generic_schema` ("auto"): one JSON object, `{"tool_calls": [{"name": ..., "arguments": {...}}]}`
  (one call at most where `parallel_tool_calls` is false) or `{"response": "..."}`;
- `GenericToolParser`: reads it back, calls as OpenAI tool calls, a response as the content (streamed
  as it is written).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from jserve.structured.tool_parsers import ToolCall, ToolCallDelta
from jserve.structured.tools import ForcedToolStream, function_of, required_schema
from jserve.text.chat_template import render_chat_template

GENERIC = "generic"  # ToolRequest.parser for "auto" in this format
_KEYS = ("response", "tool_calls")
_WS = " \t\r\n"


def template_shows_tools(template: str | None) -> bool:
    """Whether a chat template renders the tools it is given: a probe conversation rendered with a
    tool differs from it rendered without (a template that refuses either shows none)."""
    probe = [{"role": "user", "content": "Hello"}]
    tool = {"type": "function", "function": {"name": "probe_tool", "description": "A probe.",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        return render_chat_template(template, probe, tools=[tool]) != render_chat_template(template, probe)
    except Exception:  # noqa: BLE001 - jinja2's errors and the template's own (raise_exception)
        return False


def system_text(tools: Sequence[dict], parallel: bool) -> str:
    """The system message's part that offers the tools and says how to answer."""
    lines = "\n".join(json.dumps({k: v for k, v in function_of(t).items() if k != "strict"}, ensure_ascii=False)
                      for t in tools)
    text = ("You can call these tools (one JSON object each: its name, what it does and the JSON schema of its "
            f"arguments):\n{lines}")
    what = "one or more tools" if parallel else "one tool"
    return (f'{text}\n\nAnswer with one JSON object: {{"tool_calls": [{{"name": "<tool name>", "arguments": '
            f'{{<its arguments>}}}}]}} to call {what} (their results come back to you as {{"tool_response": '
            '...}), or {"response": "<your answer>"} to answer the user directly.')


def _calls_text(calls: list[dict]) -> str:
    """An assistant message's tool calls as the model writes them in this format."""
    return json.dumps({"tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                      for c in calls]}, ensure_ascii=False)


def generic_messages(messages: Sequence[dict], tools: Sequence[dict], parallel: bool) -> list[dict]:
    """The conversation as a template without a tool format renders it: the tools in the first
    system message, assistant calls as their JSON, each run of tool results as one user message."""
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_call_id -> the function called
    results = False  # the last message out holds tool results
    for m in messages:
        if m.get("tool_calls"):
            names.update((c["id"], c["function"]["name"]) for c in m["tool_calls"])
            calls, content = _calls_text(m["tool_calls"]), m.get("content") or ""
            m = {**{k: v for k, v in m.items() if k != "tool_calls"}, "content": f"{content}\n{calls}" if content
                 else calls}
        elif m["role"] == "tool":
            name = names.get(m.get("tool_call_id", ""), m.get("name"))
            line = json.dumps({"tool_response": {**({"name": name} if name else {}), "content": m["content"]}},
                              ensure_ascii=False)
            if results:
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{line}"}
                continue
            m, results = {"role": "user", "content": line}, True
            out.append(m)
            continue
        results = False
        out.append(m)
    text = system_text(tools, parallel)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def _one_key(key: str, schema: dict) -> dict:
    return {"type": "object", "properties": {key: schema}, "required": [key], "additionalProperties": False}


def generic_schema(tools: Sequence[dict], parallel: bool, response: dict | bool | None = None) -> dict:
    """The JSON schema of an "auto" answer: tool calls, or a response (a string, or `response`'s
    schema where the request constrains its answer)."""
    return {"anyOf": [_one_key("tool_calls", required_schema(tools, parallel, "arguments")),
                      _one_key("response", {"type": "string"} if response is None else response)]}


class GenericToolParser:
    """`tool_parsers.ToolParser`'s interface for the generic format."""

    replaces_content = True  # the reply's content is the response read out of the JSON, calls or not

    def stream(self) -> "GenericToolStream":
        return GenericToolStream()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole output at once: (content, calls)."""
        stream = self.stream()
        content, _ = stream.feed(text)
        rest, _ = stream.finish()
        return content + rest, list(stream.calls)


class GenericToolStream:
    """Reads a generic answer as it streams (`feed` each new piece, then `finish`), with
    `tool_parsers.ToolCallStream`'s interface: (content, deltas) per piece.

    A `{"response": "..."}` string streams as content while it is written (its JSON escapes
    decoded; a non-string response goes out whole once complete); the calls of `{"tool_calls":
    [...]}` each go out once their element is complete. Output of another shape (the grammar cut by
    `max_tokens` or a stop string before it chose) is content, whole, at `finish`.
    """

    def __init__(self) -> None:
        self._text = ""
        self._mode = "start"  # start | response (a string) | value (another JSON value) | calls | done
        self._pos = 0  # response / value: where the next undecoded character is
        self._calls: ForcedToolStream | None = None

    @property
    def calls(self) -> list[ToolCall]:
        return self._calls.calls if self._calls is not None else []

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self._text += delta
        if self._mode == "calls":
            return self._calls.feed(delta)
        if self._mode == "start":
            head = _header(self._text)
            if head is None:
                return "", []
            key, pos = head
            if key == "tool_calls":
                self._mode, self._calls = "calls", ForcedToolStream(None, "arguments")
                return self._calls.feed(self._text[pos:])
            if key == "response":
                self._mode, self._pos = ("response", pos + 1) if self._text[pos] == '"' else ("value", pos)
            else:
                self._mode = "done"  # not this format: content at finish
        return self._advance(final=False), []

    def _advance(self, final: bool) -> str:
        """The response's content decided since the last call."""
        if self._mode == "response":
            end, closed = _string_end(self._text, self._pos)
            piece, self._pos = _decode(self._text[self._pos:end]), end
            if closed:
                self._mode = "done"
            return piece
        if self._mode == "value":
            try:
                _, end = json.JSONDecoder().raw_decode(self._text, self._pos)
            except (ValueError, RecursionError):
                if not final:
                    return ""
                end = len(self._text)
            self._mode = "done"
            return self._text[self._pos:end].strip()
        return ""

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What was held back: the calls are final; an answer of no known shape is content."""
        if self._mode == "calls":
            if self._calls.calls:
                return "", []
            self._mode = "done"
            return self._text.strip(), []
        if self._mode in ("start", "done") and self._pos == 0:
            self._mode = "done"
            return self._text.strip(), []
        return self._advance(final=True), []


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _header(text: str) -> tuple[str, int] | None:
    """Once decided: (the answer's key, where its value starts), or ("", 0) where the text is not
    this format; None while it may still become `{"response": ` or `{"tool_calls": `."""
    i = _skip(text, 0)
    if i < len(text) and text[i] != "{":
        return "", 0
    i = _skip(text, i + 1)
    if i >= len(text):
        return None
    if text[i] != '"':
        return "", 0
    j = text.find('"', i + 1)
    key = text[i + 1:j if j >= 0 else len(text)]
    if j < 0:
        return None if any(k.startswith(key) for k in _KEYS) else ("", 0)
    i = _skip(text, j + 1)
    if key not in _KEYS or (i < len(text) and text[i] != ":"):
        return "", 0
    i = _skip(text, i + 1)
    return (key, i) if i < len(text) else None


def _string_end(text: str, pos: int) -> tuple[int, bool]:
    """How far from `pos` a JSON string's characters are complete (a cut escape waits for the
    next piece), and whether its closing quote is there."""
    i = pos
    while i < len(text):
        c = text[i]
        if c == '"':
            return i, True
        if c != "\\":
            i += 1
            continue
        if i + 1 >= len(text):
            break
        if text[i + 1] != "u":
            i += 2
            continue
        width = 12 if text[i + 2:i + 4].lower() in ("d8", "d9", "da", "db") else 6  # a surrogate pair
        if i + width > len(text):
            break
        i += width
    return i, False


def _decode(chars: str) -> str:
    """A JSON string's characters, unescaped (as written where they are not valid JSON)."""
    if "\\" not in chars:
        return chars
    try:
        text: Any = json.loads(f'"{chars}"', strict=False)
    except ValueError:
        return chars
    return text.encode("utf-8", "replace").decode("utf-8")

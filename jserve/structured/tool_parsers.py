"""Tool calls out of a model's generated text, whole (`ToolParser.parse`) and streamed (`ToolParser.stream`).

For OpenAI's `/v1/chat/completions` with `tools` and `tool_choice: "auto"`: the model writes its calls in the format
its chat template taught it, and these parsers turn them into OpenAI `tool_calls`. Two formats:

``hermes`` (Hermes 2 Pro, Qwen2.5 / Qwen3, many ChatML models) and ``llama3_json`` (Llama 3.1 -
3.3); `ToolParser`'s docstring gives both formats, what makes a call valid, and how streaming holds
content back. See docs/architecture.md, "Structured outputs".
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
import uuid


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object: json.dumps(obj, ensure_ascii=False)
    id: str = dataclasses.field(default_factory=_new_id)


@dataclasses.dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a call, in the shape of OpenAI's ``delta.tool_calls[i]``."""

    index: int  # 0, 1, ... in call order
    id: str | None = None  # on a call's first delta only
    name: str | None = None  # on a call's first delta only
    arguments: str = ""  # a piece of the arguments JSON; a call's pieces concatenated are ToolCall.arguments

    def to_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # NaN / Infinity would not survive json.dumps as JSON


def _call_from_obj(obj, names: frozenset[str] | None = None, need_arguments: bool = False) -> ToolCall | None:
    """The call a decoded JSON value describes, or None where it is not a valid call: no string
    `name`, a name outside `names` (the request's tools, when given), or, with `need_arguments`,
    neither `arguments` nor `parameters` (a plain JSON answer such as `{"name": "John"}`)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    if need_arguments and "arguments" not in obj and "parameters" not in obj:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        try:
            args = _DECODER.decode(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def _call_from_text(text: str, names: frozenset[str] | None = None) -> ToolCall | None:
    """The call `text` (one JSON object, whitespace around it allowed) describes, or None."""
    try:
        return _call_from_obj(_DECODER.decode(text), names)  # decode() allows surrounding whitespace, nothing else
    except (ValueError, RecursionError):
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (what must wait for the next piece)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallStream(abc.ABC):
    """Incremental parse of one generation. `calls` holds the calls completed so far (same ids as their deltas)."""

    def __init__(self, names: frozenset[str] | None = None) -> None:
        self.names = names  # the function names a call may have (None: any)
        self.calls: list[ToolCall] = []
        self._buf = ""  # text received but not yet decided
        self._ws = ""  # trailing content whitespace held until more content follows
        self._started = False  # whether any content has gone out (leading whitespace is dropped before that)
        self._done = False

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Take the next piece of generated text; return (content to send now, tool-call deltas to send now)."""
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of generation: decide what was held back (an unfinished or invalid call becomes content)."""
        if self._done:
            return "", []
        self._done = True
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        pieces: list[str] = []
        deltas: list[ToolCallDelta] = []
        self._step(pieces, deltas, final)
        text = self._ws + "".join(pieces)
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._ws = text[len(body) :]
        self._started = self._started or bool(body)
        return body, deltas

    def _add(self, call: ToolCall, deltas: list[ToolCallDelta]) -> None:
        deltas.append(ToolCallDelta(index=len(self.calls), id=call.id, name=call.name, arguments=call.arguments))
        self.calls.append(call)

    @abc.abstractmethod
    def _step(self, pieces: list[str], deltas: list[ToolCallDelta], final: bool) -> None:
        """Consume what of `self._buf` can be decided: content into `pieces`, calls via `_add`."""


class _HermesStream(ToolCallStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str] | None = None) -> None:
        super().__init__(names)
        self._in_call = False  # inside <tool_call>: self._buf is the call's body so far
        self._scan = 0  # where in the body to resume looking for CLOSE

    def _step(self, pieces, deltas, final):
        while True:
            buf = self._buf
            if not self._in_call:
                i = buf.find(self.OPEN)
                if i < 0:
                    keep = 0 if final else _partial_suffix(buf, self.OPEN)
                    pieces.append(buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    return
                pieces.append(buf[:i])
                self._buf, self._in_call, self._scan = buf[i + len(self.OPEN) :], True, 0
                continue
            j = buf.find(self.CLOSE, self._scan)
            if j < 0 and not final:
                self._scan = max(0, len(buf) - len(self.CLOSE) + 1)
                return
            body = buf if j < 0 else buf[:j]
            call = _call_from_text(body, self.names)
            if call is not None:
                self._add(call, deltas)
            else:
                pieces.append(self.OPEN + body + ("" if j < 0 else self.CLOSE))
            self._buf, self._in_call = ("" if j < 0 else buf[j + len(self.CLOSE) :]), False


class _Llama3JsonStream(ToolCallStream):
    TAG = "<|python_tag|>"

    def __init__(self, names: frozenset[str] | None = None) -> None:
        super().__init__(names)
        self._mode = "start"  # start: undecided | json: in an object at self._at | sep: between objects | text
        self._at = 0  # json mode: where the object starts in self._buf
        self._tried = 0  # json mode: how much of self._buf the last failed decode saw

    def _step(self, pieces, deltas, final):
        while True:
            buf = self._buf
            if self._mode == "text":
                pieces.append(buf)
                self._buf = ""
                return
            if self._mode == "json":
                if "}" not in buf[self._tried :]:  # an object can only complete with a "}" not yet tried
                    if final:
                        self._mode = "text"
                        continue
                    return
                try:
                    obj, end = _DECODER.raw_decode(buf, self._at)
                except (ValueError, RecursionError):
                    self._tried = len(buf)
                    continue
                call = _call_from_obj(obj, self.names, need_arguments=True)
                if call is None:  # JSON, but not a call (e.g. JSON-mode output): it and all after it are content
                    self._mode = "text"
                    continue
                self._add(call, deltas)
                self._buf, self._mode = buf[end:], "sep"
                continue
            rest = buf.lstrip()
            if self._mode == "start":
                if rest.startswith(self.TAG):
                    rest = rest[len(self.TAG) :].lstrip()
                elif self.TAG.startswith(rest) and not final:  # nothing yet, or part of the tag
                    return
            elif rest.startswith(";"):  # sep mode
                rest = rest[1:].lstrip()
            if not rest:
                if final:  # only whitespace, a tag or a trailing ";": nothing to say
                    self._buf, self._mode = "", "text"
                    continue
                return
            if rest[0] == "{":
                self._mode, self._at, self._tried = "json", len(buf) - len(rest), len(buf) - len(rest)
            else:
                self._mode = "text"


class ToolParser(abc.ABC):
    """One model format of tool calls. Stateless: `stream()` makes the per-generation state.

    - ``hermes`` (Hermes 2 Pro, Qwen2.5 / Qwen3 and many ChatML models): each call is
      ``<tool_call>{"name": "fn", "arguments": {...}}</tool_call>`` (whitespace around the JSON varies, `arguments` may
      be an object or a JSON string holding one); calls may follow one another, and text around them is content. A call
      whose closing tag never came is still a call when its JSON is complete and nothing but whitespace follows it.
    - ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole output, after whitespace and an optional ``<|python_tag|>``, is
      ``{"name": "fn", "parameters": {...}}`` (or ``"arguments"``), several such objects separated by ``;`` (or only by
      whitespace). Output whose first non-space character (after the tag) is not ``{`` is plain content.

    A call is valid when its JSON parses, its ``name`` is a non-empty string and its arguments are an object (missing
    arguments are taken as ``{}``); anything else stays in the content, text and markup alike, so nothing is lost and
    nothing raises. Given the request's tool names (`get_parser(name, names)`), a call to any other name is content
    too; llama3_json also needs `parameters` or `arguments`, so a plain JSON answer (`{"name": "John"}`) stays content.

    Streaming: `ToolCallStream.feed` takes each new piece of text (any split) and returns the content to send now
    and the tool-call deltas to send now; `finish` flushes what was held back. Content is held back only while it
    could still be markup (a partial ``<tool_call>``, llama3's undecided start, a call's JSON) and, whitespace,
    until it is known not to be the end of the content. Each call goes out as one delta, when it is complete,
    carrying its id, name and whole arguments. Whatever the split, the content pieces concatenated equal
    ``parse(text)[0]`` and the calls equal ``parse(text)[1]`` (`parse` is the stream fed in one piece); content is
    stripped of surrounding whitespace.
    """

    name: str

    def __init__(self, names=None) -> None:
        """`names`: the function names a call may have (the request's tools); a call to another
        name stays content. None: any name."""
        self.names = None if names is None else frozenset(names)

    @abc.abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one generation."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content outside the calls, stripped of markup and surrounding whitespace; the calls) of a whole output."""
        stream = self.stream()
        content, _ = stream.feed(text)
        rest, _ = stream.finish()
        return content + rest, list(stream.calls)


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> ToolCallStream:
        return _HermesStream(self.names)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> ToolCallStream:
        return _Llama3JsonStream(self.names)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def get_parser(name: str, names=None) -> ToolParser:
    """The parser registered as `name` (accepting calls to `names` only, when given); ValueError
    naming it and the known ones otherwise."""
    try:
        return TOOL_PARSERS[name](names)
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


# Llama 3.1's tool prompt: 'Respond in the format {"name": function name, "parameters": dictionary of argument ...'
_LLAMA_PARAMETERS = re.compile(r'\\?"parameters\\?"\s*:\s*dictionary')


def parser_for_template(chat_template: str | None) -> str | None:
    """The tool parser a chat template implies: "hermes", "llama3_json", or None (no tool format recognised)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if (
        "<|python_tag|>" in chat_template
        or "Environment: ipython" in chat_template
        or _LLAMA_PARAMETERS.search(chat_template)
    ):
        return "llama3_json"
    return None

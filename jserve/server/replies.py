"""The choices of a completions / chat reply: what each holds as the engine's outputs arrive, and
their OpenAI shapes, streamed (`chunk`) and whole (`final_choice`), with tool calls read back."""

from __future__ import annotations

from typing import Any

from jserve.server import protocol
from jserve.server.response_logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from jserve.structured import tool_parsers
from jserve.structured.generic_tools import GENERIC, GenericToolParser
from jserve.structured.tools import ForcedToolParser


class Choice:
    def __init__(self, index: int, prefix: str, tool_parser: Any = None, reasoning: Any = None):
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finish_reason: str | None = None
        self.prefix = prefix  # echoed prompt, sent first
        self.started = False
        self.tool_parser = tool_parser  # reads tool calls out of the text (chat with tools), or None
        self.tool_stream = tool_parser.stream() if tool_parser is not None else None
        # what reply_fields adds: the stop that ended it, the prompt's ids, the ids and prompt sent so far
        self.stop_reason: int | str | None = None
        self.prompt_token_ids: list[int] = []
        self.ids_sent = 0
        self.prompt_sent = False
        self.reasoning = reasoning  # splits the thinking out (a ReasoningParser), or None
        self.reasoning_stream = reasoning.stream() if reasoning is not None else None


def tool_parser(req: protocol.GenerateRequest) -> Any:
    """What reads the request's tool calls back: the grammar's shape for a forced choice, the
    model's own format for "auto"; None without tools or for "none"."""
    tools = req.tools
    if tools is None or not tools.calls_expected:
        return None
    if tools.choice == "auto" and tools.parser == GENERIC:
        return GenericToolParser()
    if tools.choice == "auto":  # calls to functions outside the request's tools stay content
        return tool_parsers.get_parser(tools.parser, [t["function"]["name"] for t in tools.tools])
    return ForcedToolParser(tools.forced_name)


def _finish_reason(reason: str | None, calls: list) -> str | None:
    """OpenAI's "tool_calls" where the choice ended on its own with tool calls."""
    return "tool_calls" if reason == "stop" and calls else reason


def _openai_calls(req: protocol.GenerateRequest, calls: list) -> list:
    """The calls a reply may carry: the first only where parallel_tool_calls is false."""
    return calls if req.tools is None or req.tools.parallel else calls[:1]


def chunk(req: protocol.GenerateRequest, ch: Choice, delta: Any, offset: int, tok: Any,
          scored: tuple[list[int], list] | None) -> dict | None:
    """One streamed choice for the new part `delta` (a CompletionOutput of deltas); None where a
    tool-call parser holds the whole part back. An echo with logprobs sends the prompt's (`scored`)
    in the first."""
    first, ch.started = not ch.started, True
    text = ch.prefix + delta.text if first else delta.text
    thought = ""
    if req.chat and ch.reasoning_stream is not None:
        thought, text = _split_reasoning(req, ch, text, delta.finish_reason is not None)
    if req.chat and ch.tool_stream is not None:
        return _toolchunk(req, ch, delta, text, first, tok, thought)
    if req.chat:
        d: dict = {"role": "assistant", "content": text} if first else {"content": text}
        logprobs = (chat_logprobs(delta.token_ids, delta.logprobs, tok, req.top_logprobs)
                    if delta.logprobs is not None and req.include_reasoning else None)
        if ch.reasoning is not None:
            return _reasoning_chunk(ch, d, text, thought, logprobs, delta.finish_reason, first)
        return {"index": ch.index, "delta": d, "logprobs": logprobs, "finish_reason": delta.finish_reason}
    if first and req.echo_logprobs is not None:
        ids, lps = scored
        logprobs = completion_logprobs([*ids, *delta.token_ids], [*lps, *delta.logprobs], tok, 0, req.echo_logprobs)
    else:
        logprobs = (completion_logprobs(delta.token_ids, delta.logprobs, tok, offset)
                    if delta.logprobs is not None else None)
    return {"index": ch.index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}


def _split_reasoning(req: protocol.GenerateRequest, ch: Choice, text: str, last: bool) -> tuple[str, str]:
    """(thinking, content) of a streamed piece; the thinking is dropped for include_reasoning false."""
    thought, content = ch.reasoning_stream.feed(text)
    if last:
        more, rest = ch.reasoning_stream.finish()
        thought, content = thought + more, content + rest
    return (thought if req.include_reasoning else ""), content


def _reasoning_chunk(ch: Choice, d: dict, text: str, thought: str, logprobs: Any, finish: str | None,
                     first: bool) -> dict | None:
    """A streamed chat choice of a reasoning model: `delta.reasoning` while it thinks, then
    `delta.content`; None where the piece held nothing to send."""
    if not text and not first:
        d.pop("content")
    if thought:
        d["reasoning"] = thought
    if not first and not text and not thought and finish is None and not logprobs:
        return None
    return {"index": ch.index, "delta": d, "logprobs": logprobs, "finish_reason": finish}


def _toolchunk(req: protocol.GenerateRequest, ch: Choice, delta: Any, text: str, first: bool,
                tok: Any, thought: str = "") -> dict | None:
    """A streamed chat choice whose text may hold tool calls: content the parser lets through,
    and `delta.tool_calls` as each call is read (the openai client assembles them)."""
    content, calls = ch.tool_stream.feed(text)
    if delta.finish_reason is not None:
        more, last = ch.tool_stream.finish()
        content, calls = content + more, calls + last
    if req.tools is not None and not req.tools.parallel:
        calls = [c for c in calls if c.index == 0]
    logprobs = (chat_logprobs(delta.token_ids, delta.logprobs, tok, req.top_logprobs)
                if delta.logprobs is not None and req.include_reasoning else None)
    finish = _finish_reason(delta.finish_reason, ch.tool_stream.calls)
    d: dict = {"role": "assistant"} if first else {}
    if content or first:
        d["content"] = content if content else None
    if thought:
        d["reasoning"] = thought
    if calls:
        d["tool_calls"] = [c.to_openai() for c in calls]
    if not first and not content and not thought and not calls and finish is None and not logprobs:
        return None
    return {"index": ch.index, "delta": d, "logprobs": logprobs, "finish_reason": finish}


def final_choice(req: protocol.GenerateRequest, ch: Choice, tok: Any, scored: tuple[list[int], list] | None
                  ) -> dict:
    """A whole reply's choice; `scored`: its prompt's ids and logprobs, where the request asked for them."""
    has_lp = req.params.logprobs is not None
    if req.chat:
        logprobs = chat_logprobs(ch.token_ids, ch.logprobs, tok, req.top_logprobs) if has_lp else None
        thought, text = ch.reasoning.parse(ch.text) if ch.reasoning is not None else (None, ch.text)
        message: dict = {"role": "assistant", "content": text}
        finish = ch.finish_reason
        if ch.tool_parser is not None:
            content, calls = ch.tool_parser.parse(text or "")
            calls = _openai_calls(req, calls)
            if calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": [{"id": c.id, "type": "function",
                                           "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
                finish = _finish_reason(finish, calls)
            elif getattr(ch.tool_parser, "replaces_content", False):  # the generic format's response
                message["content"] = content
        if ch.reasoning is not None:  # vLLM's field (its older name, reasoning_content, is no longer sent)
            message["reasoning"] = thought if req.include_reasoning else None
        return {"index": ch.index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    if req.echo_logprobs is not None:  # the prompt's tokens first, the first with null logprobs
        ids, lps = scored
        logprobs = completion_logprobs([*ids, *ch.token_ids], [*lps, *ch.logprobs], tok, 0, req.echo_logprobs)
    else:
        logprobs = completion_logprobs(ch.token_ids, ch.logprobs, tok, len(ch.prefix)) if has_lp else None
    choice = {"index": ch.index, "text": ch.prefix + ch.text, "logprobs": logprobs, "finish_reason": ch.finish_reason}
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs(*scored, tok, req.prompt_logprobs)
    return choice

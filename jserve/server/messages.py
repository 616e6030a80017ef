"""A chat body's `messages`, validated into the form chat templates read."""

from __future__ import annotations

import json
from typing import Any

from jserve.server import fields
from jserve.server.errors import bad_request
from jserve.server.readers import show, str_field, type_error

_ROLES = ("system", "user", "assistant", "tool", "developer")


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"messages must be a non-empty list of messages, got {show(messages)}", param="messages")
    out = []
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise type_error(name, "an object with 'role' and 'content'", m)
        fields.check_fields(m, fields.MESSAGE, name)
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(f"{name}.role must be one of {', '.join(_ROLES)}, got {show(role)}", param=name)
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"{name}.content parts must be {{'type': 'text', 'text': str}}, got "
                                      f"{show(part)}", param=f"{name}.content")
                fields.check_fields(part, fields.CONTENT_PART, f"{name}.content[{j}]")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise type_error(f"{name}.content", "a string, a list of text parts or null", content)
        msg = {"role": role, "content": content}
        for key in ("name", "tool_call_id"):
            value = str_field(m, key) if key in m else None
            if value is not None:
                msg[key] = value
        if m.get("tool_calls"):
            if role != "assistant":
                raise bad_request(f"{name}.tool_calls is for assistant messages, got role {role}",
                                  param=f"{name}.tool_calls")
            msg["tool_calls"] = _message_tool_calls(m["tool_calls"], f"{name}.tool_calls")
        thought = _message_reasoning(m, name)
        if thought is not None:  # both names, as vLLM passes it: Qwen3's template reads reasoning_content
            msg["reasoning"] = msg["reasoning_content"] = thought
        out.append(msg)
    return out


def _message_reasoning(m: dict, name: str) -> str | None:
    """An assistant message's thinking sent back (`reasoning`, or the older `reasoning_content`)."""
    given = {key: str_field(m, key) for key in ("reasoning", "reasoning_content") if m.get(key) is not None}
    if not given:
        return None
    key = next(iter(given))
    if m.get("role") != "assistant":
        raise bad_request(f"{name}.{key} is for assistant messages, got role {m.get('role')}", param=f"{name}.{key}")
    if len(set(given.values())) > 1:
        raise bad_request(f"{name}.reasoning and {name}.reasoning_content differ: give one", param=f"{name}.reasoning")
    return given[key]


def _message_tool_calls(calls: Any, name: str) -> list[dict]:
    """An assistant message's tool calls as chat templates read them (transformers' form: the
    arguments as an object, not OpenAI's JSON text)."""
    if not isinstance(calls, list):
        raise type_error(name, "a list of tool calls", calls)
    out = []
    for j, call in enumerate(calls):
        where = f"{name}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\"}}}}, got {show(call)}", param=where)
        fields.check_fields(call, fields.TOOL_CALL, where)
        fields.check_fields(fn, fields.TOOL_CALL_FUNCTION, f"{where}.function")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                raise bad_request(f"{where}.function.arguments must be JSON text, got {show(arguments)}",
                                  param=f"{where}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise type_error(f"{where}.function.arguments", "a JSON object", arguments)
        out.append({"id": str_field(call, "id") or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def messages_bytes(messages: list[dict]) -> int:
    """UTF-8 bytes of the text the messages hold (the size the chat template will render)."""
    try:
        return sum(len(v.encode()) if isinstance(v, str) else len(json.dumps(v).encode())
                   for m in messages for v in m.values())
    except RecursionError:
        raise bad_request("messages are nested too deeply", param="messages") from None

"""OpenAI request bodies -> validated prompts and `SamplingParams` (the replies' logprob shapes are in
`response_logprobs.py`).

Every check raises `APIError(400)` naming the field and the bad value; `SamplingParams`' own
ValueErrors (which start with the field's name) are mapped the same way. Validation runs in two
phases around tokenization (which may go to a worker process): `parse_completion` / `parse_chat`
check every field and leave text prompts untokenized; `check_prompts` then checks the token ids
and lengths against the model and the limits.
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
from typing import Any

from jserve.core.request import SamplingParams
from jserve.server import fields, logit_controls, structured
from jserve.server.errors import APIError, bad_request
from jserve.server.limits import Limits
from jserve.server.structured import ToolRequest

_ROLES = ("system", "user", "assistant", "tool", "developer")
# repr of a client's value for an error message, never more than a few dozen items deep or wide
_REPR = reprlib.Repr(maxlevel=3, maxlist=8, maxdict=8, maxstring=80, maxother=80, maxlong=80)


@dataclasses.dataclass
class GenerateRequest:
    """One validated /v1/completions or /v1/chat/completions body."""

    chat: bool
    # (text if known, token ids) per prompt; ids are None until the text is tokenized
    prompts: list[tuple[str | None, list[int] | None]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    priority: int = 0
    cache_salt: str | None = None  # the client's; the engine gets it mixed with the tenant
    top_logprobs: int | None = None  # chat: alternatives listed per token (None: no logprobs)
    prompt_logprobs: int | None = None  # the field: alternatives per prompt position in the reply (None: none)
    echo_logprobs: int | None = None  # completions: echo with logprobs, alternatives per echoed prompt token
    messages: list[dict] | None = None  # chat: rendered into prompts[0] by the chat template
    add_generation_prompt: bool = True
    tools: ToolRequest | None = None  # chat: the tools offered and how calls are read back
    constraint_param: str | None = None  # the field the output constraint came from (for its errors)

    @property
    def num_seqs(self) -> int:
        """Engine sequences this request runs: n per prompt."""
        return self.params.n * len(self.prompts)

    def cost_tokens(self, max_total_tokens: int) -> int:
        """Tokens its sequences may come to hold: prompt plus max_tokens (or what the context
        leaves), per sequence."""
        n, max_tokens = self.params.n, self.params.max_tokens
        if max_tokens is not None:
            max_tokens = max(max_tokens, 1)  # a request for none still samples one (LLMEngine.add_request)
        return sum(n * (min(len(ids) + max_tokens, max_total_tokens) if max_tokens is not None else max_total_tokens)
                   for _, ids in self.prompts)


@dataclasses.dataclass(frozen=True)
class Context:
    """What validation needs to know about the served model."""

    model_names: tuple[str, ...]  # the first is the one responses name
    max_model_len: int
    vocab_size: int  # of the model (token ids the engine accepts)
    limits: Limits  # resolved (`Limits.resolve`)
    allow_priority: bool = False  # --scheduling-policy priority
    tool_parser: str | None = None  # what reads tool calls for tool_choice "auto" (None: refused)

    @property
    def model_name(self) -> str:
        return self.model_names[0]


# ------------------------------------------------------------------------------ field readers

def _type_error(name: str, want: str, value: Any) -> APIError:
    return bad_request(f"{name} must be {want}, got {show(value)}", param=name)


def show(value: Any) -> str:
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(body: dict, name: str, default: Any = None, lo: int | None = None, hi: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_request(f"{name} must be in [{lo}, {hi}], got {show(value)}", param=name)
    return value


def _float(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(name, "a finite number", value)
    return float(value)


def bool_field(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return value


def token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise bad_request(f"{name} must be a non-empty list of token ids, got {show(value)}", param=name)
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise _type_error(name, "a list of integer token ids", t)
        if not 0 <= t < vocab_size:
            raise bad_request(f"token id {t} in {name} is outside the vocabulary [0, {vocab_size})", param=name)
    return list(value)


def check_model(body: dict, ctx: Context) -> None:
    model = body.get("model")
    if model is None:
        return  # OpenAI requires it; we serve one model, so a missing name is harmless
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    if model not in ctx.model_names:
        served = ", ".join(f"`{m}`" for m in ctx.model_names)
        raise APIError(400, f"The model `{show(model)[1:-1]}` does not exist; this server serves {served}.",
                       param="model", code="model_not_found")


# ------------------------------------------------------------------------------ requests

def _stop(body: dict, limits: Limits) -> list[str] | str | None:
    stop = body.get("stop")
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _type_error("stop", "a string or a list of strings", stop)
    if len(items) > limits.max_stop:
        raise bad_request(f"stop may hold at most {limits.max_stop} strings, got {len(items)}", param="stop")
    for s in items:
        if len(s) > limits.max_stop_chars:
            raise bad_request(f"each stop string may be at most {limits.max_stop_chars} characters, got one of "
                              f"{len(s)}: {show(s)}", param="stop")
    return stop


def _stop_token_ids(body: dict, ctx: Context) -> list[int] | None:
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        return None
    limit = ctx.limits.max_stop_token_ids
    if not isinstance(stop_ids, list) or len(stop_ids) > limit:
        raise _type_error("stop_token_ids", f"a list of at most {limit} token ids", stop_ids)
    for t in stop_ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise _type_error("stop_token_ids", "a list of integer token ids", t)
        if not 0 <= t < ctx.vocab_size:
            raise bad_request(f"token id {show(t)} in stop_token_ids is outside the vocabulary "
                              f"[0, {ctx.vocab_size})", param="stop_token_ids")
    return list(stop_ids)


def _sampling(body: dict, ctx: Context, *, max_tokens: int | None, logprobs: int | None,
              num_prompts: int, constraint=None, prompt_logprobs: int | None = None) -> SamplingParams:
    limits = ctx.limits
    n = _int(body, "n", 1, 1, limits.max_n)
    if n * num_prompts > limits.max_n:
        raise bad_request(f"n * number of prompts must be at most {limits.max_n}, got {n} * {num_prompts}",
                          param="n")
    best_of = _int(body, "best_of")
    if best_of is not None and best_of != n:
        raise bad_request(f"best_of != n is not supported, got best_of={best_of}", param="best_of")
    stop = _stop(body, limits)
    stop_ids = _stop_token_ids(body, ctx)
    temperature = _float(body, "temperature", 1.0)
    if 0 < temperature < 1e-5:
        temperature = 0.0  # as greedy: dividing logits by it would overflow
    temperature = min(temperature, 1e6)  # beyond that it is uniform anyway; float32 would overflow
    top_p = _float(body, "top_p", 1.0)
    if 0 < top_p < 1e-6:
        top_p = 1e-6  # float32 would round it to 0
    top_k = _int(body, "top_k", 0, -1, 2**31 - 1)
    if top_k >= ctx.vocab_size:
        top_k = 0  # no restriction; keeps it inside int32 in the step
    repetition_penalty = _float(body, "repetition_penalty", 1.0)
    if 0 < repetition_penalty < 1e-2:
        raise bad_request(f"repetition_penalty must be in [0.01, 10], got {repetition_penalty!r}",
                          param="repetition_penalty")
    kwargs = dict(
        n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=_float(body, "min_p", 0.0),
        repetition_penalty=repetition_penalty, presence_penalty=_float(body, "presence_penalty", 0.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0), seed=_int(body, "seed", None, -2**63, 2**64 - 1),
        max_tokens=max_tokens, min_tokens=_int(body, "min_tokens", 0, 0, ctx.max_model_len), stop=stop,
        stop_token_ids=stop_ids, ignore_eos=bool_field(body, "ignore_eos"), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=bool_field(body, "skip_special_tokens", True),
        include_stop_str_in_output=bool_field(body, "include_stop_str_in_output"), structured_outputs=constraint,
        **logit_controls.read(body, ctx.vocab_size))
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        first = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param=first if first in kwargs else None) from None


def _common(body: dict, ctx: Context, allowed: frozenset[str]) -> dict:
    fields.check_fields(body, allowed)
    check_model(body, ctx)
    _str(body, "user")
    stream = bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    fields.check_fields(options or {}, fields.STREAM_OPTIONS, "stream_options")
    include_usage = bool_field(options or {}, "include_usage")
    priority = _int(body, "priority", 0, -2**31, 2**31 - 1)
    if priority != 0 and not ctx.allow_priority:
        raise bad_request(f"priority is not accepted (got {priority}): this server schedules first come, first "
                          f"served (start it with --scheduling-policy priority to allow it)", param="priority")
    cache_salt = _str(body, "cache_salt")
    if cache_salt is not None and not 0 < len(cache_salt) <= ctx.limits.max_cache_salt_chars:
        raise bad_request(f"cache_salt must be 1 to {ctx.limits.max_cache_salt_chars} characters, got "
                          f"{len(cache_salt)}", param="cache_salt")
    return dict(stream=stream, include_usage=include_usage, priority=priority, cache_salt=cache_salt)


def check_prompts(req: GenerateRequest, ctx: Context) -> None:
    """The tokenized prompts against the vocabulary, --max-input-tokens and --max-total-tokens."""
    limits = ctx.limits
    max_tokens = req.params.max_tokens
    param = "messages" if req.chat else "prompt"
    for _, ids in req.prompts:
        assert ids is not None, "tokenize the prompts first"
        if not ids:
            raise bad_request(f"{param} is empty: give at least one token", param=param)
        bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
        if bad:
            raise bad_request(f"prompt token id {bad[0]} is outside the model's vocabulary [0, {ctx.vocab_size})",
                              param=param)
        if len(ids) > limits.max_input_tokens:
            room = " (it must be shorter to leave room for output)" if limits.max_input_tokens == \
                limits.max_total_tokens - 1 else ""
            raise bad_request(f"This model's maximum context length is {limits.max_total_tokens} tokens and a prompt "
                              f"may have at most {limits.max_input_tokens}, but the prompt has {len(ids)} "
                              f"tokens{room}.", param=param, code="context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > limits.max_total_tokens:
            raise bad_request(f"This model's maximum context length is {limits.max_total_tokens} tokens. However, "
                              f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
                              f"for the completion). Please reduce the prompt or max_tokens.",
                              param="max_tokens", code="context_length_exceeded")


def parse_completion(body: dict, ctx: Context) -> GenerateRequest:
    """Every field of a /v1/completions body; text prompts are left for the tokenizer."""
    common = _common(body, ctx, fields.COMPLETIONS)
    if "prompt" not in body:
        raise bad_request("prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        items: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        items = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        items = list(prompt)
    else:
        raise _type_error("prompt", "a string, a list of strings, a list of token ids or a list of token-id "
                                    "lists (non-empty)", prompt)
    if len(items) > ctx.limits.max_prompts:
        raise bad_request(f"at most {ctx.limits.max_prompts} prompts per request, got {len(items)}", param="prompt")
    prompts: list[tuple[str | None, list[int] | None]] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt is empty: give at least one token", param="prompt")
            prompts.append((item, None))
        elif isinstance(item, list) and len(item) > ctx.limits.max_input_tokens:  # refused before a walk over it
            raise bad_request(f"a prompt may have at most {ctx.limits.max_input_tokens} tokens, but the prompt has "
                              f"{len(item)}", param="prompt", code="context_length_exceeded")
        else:
            prompts.append((None, token_ids(item, "prompt", ctx.vocab_size)))
    if body.get("suffix") not in (None, ""):
        raise bad_request("suffix is not supported", param="suffix")
    echo = bool_field(body, "echo")
    logprobs = _int(body, "logprobs", None, 0, ctx.limits.max_logprobs)
    echo_logprobs = logprobs if echo else None
    prompt_logprobs = _prompt_logprobs(body, ctx, common["stream"])
    max_tokens = _int(body, "max_tokens", 16, 0, 2**31 - 1)
    _check_generates(max_tokens, "max_tokens", echo or prompt_logprobs is not None, "echo or prompt_logprobs")
    constraint, field = structured.parse_constraint(body)
    scored = max((k for k in (prompt_logprobs, echo_logprobs) if k is not None), default=None)
    params = _sampling(body, ctx, max_tokens=max_tokens, logprobs=logprobs, num_prompts=len(prompts),
                       constraint=constraint, prompt_logprobs=scored)
    return GenerateRequest(chat=False, prompts=prompts, params=params, echo=echo, prompt_logprobs=prompt_logprobs,
                           echo_logprobs=echo_logprobs, constraint_param=field, **common)


def _prompt_logprobs(body: dict, ctx: Context, stream: bool) -> int | None:
    """vLLM's prompt_logprobs: the alternatives listed at each prompt position; as in vLLM, not
    streamed."""
    value = _int(body, "prompt_logprobs", None, 0, ctx.limits.max_logprobs)
    if value is not None and stream:
        raise bad_request(f"prompt_logprobs is not available with stream: true (got prompt_logprobs={value})",
                          param="prompt_logprobs")
    return value


def _check_generates(max_tokens: int | None, name: str, returns_prompt: bool, needs: str) -> None:
    """A request for no tokens scores its prompt: without the prompt back it would ask for nothing."""
    if max_tokens == 0 and not returns_prompt:
        raise bad_request(f"{name} 0 generates nothing: a request for no tokens scores the prompt, so it needs "
                          f"{needs}", param=name)


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"messages must be a non-empty list of messages, got {show(messages)}", param="messages")
    out = []
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(name, "an object with 'role' and 'content'", m)
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
            raise _type_error(f"{name}.content", "a string, a list of text parts or null", content)
        msg = {"role": role, "content": content}
        for key in ("name", "tool_call_id"):
            value = _str(m, key) if key in m else None
            if value is not None:
                msg[key] = value
        if m.get("tool_calls"):
            if role != "assistant":
                raise bad_request(f"{name}.tool_calls is for assistant messages, got role {role}",
                                  param=f"{name}.tool_calls")
            msg["tool_calls"] = _message_tool_calls(m["tool_calls"], f"{name}.tool_calls")
        out.append(msg)
    return out


def _message_tool_calls(calls: Any, name: str) -> list[dict]:
    """An assistant message's tool calls as chat templates read them (transformers' form: the
    arguments as an object, not OpenAI's JSON text)."""
    if not isinstance(calls, list):
        raise _type_error(name, "a list of tool calls", calls)
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
            raise _type_error(f"{where}.function.arguments", "a JSON object", arguments)
        out.append({"id": _str(call, "id") or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def messages_bytes(messages: list[dict]) -> int:
    """UTF-8 bytes of the text the messages hold (the size the chat template will render)."""
    try:
        return sum(len(v.encode()) if isinstance(v, str) else len(json.dumps(v).encode())
                   for m in messages for v in m.values())
    except RecursionError:
        raise bad_request("messages are nested too deeply", param="messages") from None


def parse_chat(body: dict, ctx: Context) -> GenerateRequest:
    """Every field of a /v1/chat/completions body; the messages are left for the chat template."""
    common = _common(body, ctx, fields.CHAT)
    messages = parse_messages(body)
    add_generation_prompt = bool_field(body, "add_generation_prompt", True)
    want_logprobs = bool_field(body, "logprobs")
    top = _int(body, "top_logprobs", None, 0, ctx.limits.max_logprobs)
    if top is not None and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    top_logprobs = (top or 0) if want_logprobs else None
    prompt_logprobs = _prompt_logprobs(body, ctx, common["stream"])
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_field, None, 0, 2**31 - 1)
    _check_generates(max_tokens, max_field, prompt_logprobs is not None, "prompt_logprobs")
    tools = structured.parse_tools(body, ctx.tool_parser)
    constraint, field = structured.chat_constraint(body, tools)
    params = _sampling(body, ctx, max_tokens=max_tokens, logprobs=top_logprobs, num_prompts=1, constraint=constraint,
                       prompt_logprobs=prompt_logprobs)
    return GenerateRequest(chat=True, prompts=[(None, None)], params=params, top_logprobs=top_logprobs,
                           prompt_logprobs=prompt_logprobs, messages=messages,
                           add_generation_prompt=add_generation_prompt, tools=tools, constraint_param=field, **common)

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
from typing import Any, Mapping

from jserve.core.request import SamplingParams
from jserve.server import fields, reply_fields, sampling_body, structured
from jserve.server.errors import APIError, bad_request
from jserve.server.limits import Limits
from jserve.server.messages import parse_messages
from jserve.server.readers import bool_field, int_field, show, str_field, token_ids, type_error
from jserve.server.structured import ToolRequest
from jserve.server.tokenizer_pool import ChatPrompt
from jserve.structured import reasoning
from jserve.structured.generic_tools import GENERIC, generic_messages


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
    # vLLM's extra fields (`reply_fields`)
    truncate_prompt_tokens: int | None = None  # keep each prompt's last k tokens
    add_special_tokens: bool = True  # the tokenizer's BOS on the prompt (chat: False)
    continue_final_message: bool = False  # chat: the last (assistant) message is continued
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # return_tokens_as_token_ids
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    chat_template_kwargs: dict | None = None  # chat: the client's template variables (enable_thinking, ...)
    include_reasoning: bool = True  # chat: false drops the reasoning from the reply
    reasoning_parser: str | None = None  # chat: the server's --reasoning-parser
    lora_request: Any = None  # the LoRA adapter `model` named (`jserve.server.loras`); None: the base model
    reasoning: reasoning.ReasoningParser | None = None  # what splits the thinking out, once rendered

    def chat_prompt(self) -> ChatPrompt:
        """What the chat template renders for this request (tools offered where calls may come)."""
        tools = self.tools
        variables = dict(self.chat_template_kwargs or {})
        messages = self.messages
        if tools is not None and tools.parser == GENERIC:  # no tool format jserve reads: the tools as text
            messages = generic_messages(messages, tools.tools, tools.parallel)
        elif tools is not None and tools.choice != "none":
            variables["tools"] = list(tools.tools)
        return ChatPrompt(messages, self.add_generation_prompt, variables=variables,
                          continue_final_message=self.continue_final_message,
                          add_special_tokens=self.add_special_tokens)

    def start_reasoning(self) -> None:
        """Once the chat prompt is rendered: whether this request thinks (`reasoning.get_parser`),
        and if so its output constraint applies after the thinking."""
        if self.reasoning_parser is None:
            return
        self.reasoning = reasoning.get_parser(self.reasoning_parser, self.chat_template_kwargs, self.prompts[0][0])
        spec = self.params.structured_outputs
        if spec is not None and self.reasoning.thinking:
            spec = dataclasses.replace(spec, reasoning=True)
            self.params = dataclasses.replace(self.params, structured_outputs=spec)

    @property
    def num_seqs(self) -> int:
        """Engine sequences this request runs: n (best_of) per prompt."""
        return self.params.num_samples * len(self.prompts)

    def cost_tokens(self, max_total_tokens: int) -> int:
        """Tokens its sequences may come to hold: prompt plus max_tokens (or what the context
        leaves), per sequence."""
        n, max_tokens = self.params.num_samples, self.params.max_tokens
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
    # the model's sampling defaults for fields a request leaves out (`--generation-config`)
    sampling_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    reasoning_parser: str | None = None  # what splits a chat reply's thinking out (--reasoning-parser)
    loras: Any = None  # the server's `ServedLoras` (a model name may be an adapter's)

    @property
    def model_name(self) -> str:
        return self.model_names[0]



def check_model(body: dict, ctx: Context) -> Any:
    """The LoRA adapter (`LoRARequest`) that `model` names, or None: the base model."""
    model = body.get("model")
    if model is None:
        return None  # OpenAI requires it; we serve one model, so a missing name is harmless
    if not isinstance(model, str):
        raise type_error("model", "a string", model)
    if model not in ctx.model_names and ctx.loras is not None and ctx.loras.enabled:
        return ctx.loras.lookup(model)  # vLLM's 404 for a name neither the model's nor an adapter's
    if model not in ctx.model_names:
        served = ", ".join(f"`{m}`" for m in ctx.model_names)
        raise APIError(400, f"The model `{show(model)[1:-1]}` does not exist; this server serves {served}.",
                       param="model", code="model_not_found")



def _common(body: dict, ctx: Context, allowed: frozenset[str]) -> dict:
    fields.check_fields(body, allowed)
    lora_request = check_model(body, ctx)
    str_field(body, "user")
    stream = bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise type_error("stream_options", "an object", options)
    fields.check_fields(options or {}, fields.STREAM_OPTIONS, "stream_options")
    include_usage = bool_field(options or {}, "include_usage")
    priority = int_field(body, "priority", 0, -2**31, 2**31 - 1)
    if priority != 0 and not ctx.allow_priority:
        raise bad_request(f"priority is not accepted (got {priority}): this server schedules first come, first "
                          f"served (start it with --scheduling-policy priority to allow it)", param="priority")
    cache_salt = str_field(body, "cache_salt")
    if cache_salt is not None and not 0 < len(cache_salt) <= ctx.limits.max_cache_salt_chars:
        raise bad_request(f"cache_salt must be 1 to {ctx.limits.max_cache_salt_chars} characters, got "
                          f"{len(cache_salt)}", param="cache_salt")
    return dict(stream=stream, include_usage=include_usage, priority=priority, cache_salt=cache_salt,
                lora_request=lora_request, **reply_fields.read(body, ctx, "messages" in allowed, include_usage))


def check_prompts(req: GenerateRequest, ctx: Context) -> None:
    """The tokenized prompts against the vocabulary, --max-input-tokens and --max-total-tokens."""
    limits = ctx.limits
    default_max = ctx.sampling_defaults.get("max_tokens")
    if req.chat and req.params.max_tokens is None and default_max is not None:  # as vLLM: within the context
        room = limits.max_total_tokens - max(len(ids) for _, ids in req.prompts)
        req.params = dataclasses.replace(req.params, max_tokens=max(1, min(default_max, room)))
    max_tokens = req.params.max_tokens
    param = "messages" if req.chat else "prompt"
    reply_fields.truncate(req)
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
        raise type_error("prompt", "a string, a list of strings, a list of token ids or a list of token-id "
                                    "lists (non-empty)", prompt)
    if len(items) > ctx.limits.max_prompts:
        raise bad_request(f"at most {ctx.limits.max_prompts} prompts per request, got {len(items)}", param="prompt")
    prompts: list[tuple[str | None, list[int] | None]] = []
    keep = common["truncate_prompt_tokens"]
    for item in items:
        if isinstance(item, list) and keep is not None:
            item = item[-keep:]
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
    logprobs = int_field(body, "logprobs", None, 0, ctx.limits.max_logprobs)
    echo_logprobs = logprobs if echo else None
    prompt_logprobs = _prompt_logprobs(body, ctx, common["stream"])
    max_tokens = int_field(body, "max_tokens", 16, 0, 2**31 - 1)
    _check_generates(max_tokens, "max_tokens", echo or prompt_logprobs is not None, "echo or prompt_logprobs")
    constraint, field = structured.parse_constraint(body)
    scored = max((k for k in (prompt_logprobs, echo_logprobs) if k is not None), default=None)
    params = sampling_body.sampling_params(body, ctx, max_tokens=max_tokens, logprobs=logprobs,
                                           num_prompts=len(prompts), constraint=constraint, prompt_logprobs=scored)
    return GenerateRequest(chat=False, prompts=prompts, params=params, echo=echo, prompt_logprobs=prompt_logprobs,
                           echo_logprobs=echo_logprobs, constraint_param=field, **common)


def _prompt_logprobs(body: dict, ctx: Context, stream: bool) -> int | None:
    """vLLM's prompt_logprobs: the alternatives listed at each prompt position; as in vLLM, not
    streamed."""
    value = int_field(body, "prompt_logprobs", None, 0, ctx.limits.max_logprobs)
    if value is not None and stream:
        raise bad_request(f"prompt_logprobs is not available with stream: true (got prompt_logprobs={value})",
                          param="prompt_logprobs")
    return value


def _check_generates(max_tokens: int | None, name: str, returns_prompt: bool, needs: str) -> None:
    """A request for no tokens scores its prompt: without the prompt back it would ask for nothing."""
    if max_tokens == 0 and not returns_prompt:
        raise bad_request(f"{name} 0 generates nothing: a request for no tokens scores the prompt, so it needs "
                          f"{needs}", param=name)


def parse_chat(body: dict, ctx: Context) -> GenerateRequest:
    """Every field of a /v1/chat/completions body; the messages are left for the chat template."""
    common = _common(body, ctx, fields.CHAT)
    messages = parse_messages(body)
    continue_final = bool_field(body, "continue_final_message")
    if continue_final and body.get("add_generation_prompt") is True:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: the reply either "
                          "continues the last message or starts a new one", param="continue_final_message")
    add_generation_prompt = bool_field(body, "add_generation_prompt", not continue_final)
    want_logprobs = bool_field(body, "logprobs")
    top = int_field(body, "top_logprobs", None, 0, ctx.limits.max_logprobs)
    if top is not None and not want_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    top_logprobs = (top or 0) if want_logprobs else None
    prompt_logprobs = _prompt_logprobs(body, ctx, common["stream"])
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = int_field(body, max_field, None, 0, 2**31 - 1)
    _check_generates(max_tokens, max_field, prompt_logprobs is not None, "prompt_logprobs")
    tools = structured.parse_tools(body, ctx.tool_parser)
    constraint, field = structured.chat_constraint(body, tools)
    params = sampling_body.sampling_params(body, ctx, max_tokens=max_tokens, logprobs=top_logprobs, num_prompts=1,
                                           constraint=constraint, prompt_logprobs=prompt_logprobs)
    return GenerateRequest(chat=True, prompts=[(None, None)], params=params, top_logprobs=top_logprobs,
                           prompt_logprobs=prompt_logprobs, messages=messages,
                           add_generation_prompt=add_generation_prompt, tools=tools, constraint_param=field,
                           continue_final_message=continue_final, chat_template_kwargs=_chat_template_kwargs(body),
                           include_reasoning=bool_field(body, "include_reasoning", True),
                           reasoning_parser=ctx.reasoning_parser, **common)


# the variables jserve itself gives the chat template (from the request's other fields)
_TEMPLATE_OWN = ("messages", "add_generation_prompt", "continue_final_message", "tools", "bos_token", "eos_token",
                 "unk_token", "pad_token")


def _chat_template_kwargs(body: dict) -> dict | None:
    """vLLM's chat_template_kwargs: more variables for the chat template (e.g. enable_thinking)."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise type_error("chat_template_kwargs", "an object", value)
    clash = [k for k in value if k in _TEMPLATE_OWN]
    if clash:
        raise bad_request(f"chat_template_kwargs.{clash[0]} is set by the server from the request (the template's "
                          f"own variables: {', '.join(_TEMPLATE_OWN)}): give it in its own field",
                          param=f"chat_template_kwargs.{clash[0]}")
    return value

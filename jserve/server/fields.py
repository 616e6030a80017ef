"""Which body fields each route implements; any other field is a 400 naming it, never dropped.

A client that sends a field the server lacks must learn that it did not get what it asked for.
OpenAI fields the server lacks are accepted only with a value that asks for nothing (null, or
their default, e.g. `"store": false`), as some clients always send them.
"""

from __future__ import annotations

from typing import Any

from jserve.server.errors import bad_request

_SAMPLING = frozenset({
    "model", "n", "best_of", "max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty",
    "frequency_penalty", "user", "logit_bias", "stream", "stream_options", "logprobs",
    # vLLM's extra sampling parameters
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "priority", "stop_token_ids", "min_tokens",
    "include_stop_str_in_output", "skip_special_tokens", "cache_salt", "prompt_logprobs", "allowed_token_ids",
    # vLLM's extra prompt and reply fields (jserve.server.reply_fields)
    "truncate_prompt_tokens", "add_special_tokens", "return_token_ids", "return_tokens_as_token_ids", "bad_words"})

# the output constraints (jserve.server.structured), OpenAI's and vLLM's spellings
_CONSTRAINTS = frozenset({"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                          "guided_grammar"})
COMPLETIONS = _SAMPLING | _CONSTRAINTS | {"prompt", "echo", "suffix"}
CHAT = _SAMPLING | _CONSTRAINTS | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                                   "tools", "tool_choice", "parallel_tool_calls", "continue_final_message",
                                   "chat_template_kwargs", "include_reasoning"}
TOKENIZE = frozenset({"model", "prompt", "messages", "add_generation_prompt", "add_special_tokens"})
DETOKENIZE = frozenset({"model", "tokens"})
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
MESSAGE = frozenset({"role", "content", "name", "tool_call_id", "tool_calls",
                     "reasoning", "reasoning_content"})  # an assistant turn's thinking, sent back
TOOL_CALL = frozenset({"id", "type", "function", "index"})
TOOL_CALL_FUNCTION = frozenset({"name", "arguments"})
CONTENT_PART = frozenset({"type", "text"})

# OpenAI fields not implemented here, with the values that ask for nothing (null always does).
_HARMLESS: dict[str, tuple[Any, ...]] = {
    "response_format": ({"type": "text"},), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",), "parallel_tool_calls": (), "store": (False,), "metadata": ({},),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (), "service_tier": ("auto",),
    "web_search_options": (), "verbosity": (), "prompt_cache_key": (), "safety_identifier": (),
    # in a message echoed back from a chat response
    "tool_calls": ([],), "refusal": (), "annotations": ([],),
}


def check_fields(obj: dict, allowed: frozenset[str], where: str = "") -> None:
    """400 naming the first key of `obj` that is not in `allowed` and asks for something."""
    for key, value in obj.items():
        if key in allowed:
            continue
        if value is None and key in _HARMLESS or value in _HARMLESS.get(key, ()):
            continue
        name = f"{where}.{key}" if where else key
        shown = name if len(name) <= 64 else name[:61] + "..."
        what = ("an OpenAI field this server does not implement" if key in _HARMLESS
                else "not a field this server knows")
        raise bad_request(f"unsupported field `{shown}`: {what} (it is refused rather than ignored)",
                          param=shown, code="unsupported_field")

# the embedding model's routes (jserve.server.embeddings), vLLM's fields
_POOLING = frozenset({"model", "user", "truncate_prompt_tokens", "add_special_tokens"})
EMBEDDINGS = _POOLING | {"input", "encoding_format", "dimensions"}
SCORE = _POOLING | {"text_1", "text_2"}
RERANK = _POOLING | {"query", "documents", "top_n"}

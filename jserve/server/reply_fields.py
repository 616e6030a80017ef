"""vLLM's extra request fields about the prompt and the reply: reading them from a body, and what
they add to a reply's choices and chunks.

- `truncate_prompt_tokens`: keep a prompt's last k tokens (-1: the model's length);
- `add_special_tokens`: whether the tokenizer adds its special tokens (BOS) to the prompt
  (completions: true; chat: false, the template wrote them);
- `return_token_ids`: each choice's `token_ids` (a chunk's new ones) and the prompt's ids (a
  completions choice's `prompt_token_ids`; a chat reply's, in its first chunk when streamed);
- `return_tokens_as_token_ids`: logprobs name tokens as "token_id:N" (`response_logprobs`);
- `stream_options.continuous_usage_stats`: usage in every chunk (with `include_usage`, as vLLM);
- `stop_reason` on every choice: the stop string or token id that ended it, null otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jserve.server.errors import bad_request
from jserve.server.readers import bool_field, int_field

if TYPE_CHECKING:
    from jserve.server.protocol import Context, GenerateRequest


def read(body: dict, ctx: Context, chat: bool, include_usage: bool) -> dict[str, Any]:
    """The GenerateRequest keywords of these fields (400s naming a bad value)."""
    truncate = int_field(body, "truncate_prompt_tokens", None, -1, ctx.max_model_len)
    if truncate == 0:
        raise bad_request(f"truncate_prompt_tokens must be -1 (the model's length, {ctx.max_model_len}) or 1 to "
                          f"{ctx.max_model_len}, got 0", param="truncate_prompt_tokens")
    continuous = bool_field(body.get("stream_options") or {}, "continuous_usage_stats")
    return dict(truncate_prompt_tokens=ctx.max_model_len if truncate == -1 else truncate,
                add_special_tokens=bool_field(body, "add_special_tokens", not chat),
                return_token_ids=bool_field(body, "return_token_ids"),
                tokens_as_ids=bool_field(body, "return_tokens_as_token_ids"),
                continuous_usage=include_usage and continuous)


def truncate(req: GenerateRequest) -> None:
    """Each tokenized prompt cut to its last `truncate_prompt_tokens` tokens (its text then goes:
    an echo shows the tokens kept)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return
    req.prompts = [(text, ids) if len(ids) <= k else (None, ids[-k:]) for text, ids in req.prompts]


def stream_extras(req: GenerateRequest, ch: Any, chunk: dict) -> None:
    """A streamed choice's `stop_reason`, and with `return_token_ids` its new token ids since the
    last chunk sent (and a completions choice's prompt ids in its first)."""
    chunk["stop_reason"] = ch.stop_reason
    if req.return_token_ids:
        if not ch.prompt_sent and not req.chat:
            chunk["prompt_token_ids"] = ch.prompt_token_ids
            ch.prompt_sent = True
        chunk["token_ids"] = ch.token_ids[ch.ids_sent:]
        ch.ids_sent = len(ch.token_ids)


def final_extras(req: GenerateRequest, ch: Any, choice: dict) -> None:
    """A whole reply's choice's `stop_reason` and, with `return_token_ids`, its ids."""
    choice["stop_reason"] = ch.stop_reason
    if req.return_token_ids:
        if not req.chat:
            choice["prompt_token_ids"] = ch.prompt_token_ids
        choice["token_ids"] = list(ch.token_ids)


def chunk_usage(ch: Any) -> dict:
    """A chunk's usage with `continuous_usage_stats`: its choice's prompt and tokens so far."""
    prompt, done = len(ch.prompt_token_ids), len(ch.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

"""A completions / chat body's sampling fields -> `SamplingParams` (its ValueErrors become 400s
naming the field)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jserve.core.request import SamplingParams
from jserve.server import logit_controls
from jserve.server.errors import bad_request
from jserve.server.limits import Limits
from jserve.server.readers import bool_field, float_field, int_field, show, type_error

if TYPE_CHECKING:
    from jserve.server.protocol import Context


def _stop(body: dict, limits: Limits) -> list[str] | str | None:
    stop = body.get("stop")
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise type_error("stop", "a string or a list of strings", stop)
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
        raise type_error("stop_token_ids", f"a list of at most {limit} token ids", stop_ids)
    for t in stop_ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise type_error("stop_token_ids", "a list of integer token ids", t)
        if not 0 <= t < ctx.vocab_size:
            raise bad_request(f"token id {show(t)} in stop_token_ids is outside the vocabulary "
                              f"[0, {ctx.vocab_size})", param="stop_token_ids")
    return list(stop_ids)


def sampling_params(body: dict, ctx: Context, *, max_tokens: int | None, logprobs: int | None,
              num_prompts: int, constraint=None, prompt_logprobs: int | None = None) -> SamplingParams:
    limits = ctx.limits
    n = int_field(body, "n", 1, 1, limits.max_n)
    if n * num_prompts > limits.max_n:
        raise bad_request(f"n * number of prompts must be at most {limits.max_n}, got {n} * {num_prompts}",
                          param="n")
    best_of = int_field(body, "best_of", None, n, limits.max_n)
    if best_of is not None and best_of * num_prompts > limits.max_n:
        raise bad_request(f"best_of * number of prompts must be at most {limits.max_n}, got {best_of} * "
                          f"{num_prompts}", param="best_of")
    if best_of not in (None, n) and body.get("stream"):
        raise bad_request(f"best_of > n is not available with stream: true (the best are known at the end), got "
                          f"best_of={best_of}", param="best_of")
    stop = _stop(body, limits)
    stop_ids = _stop_token_ids(body, ctx)
    default = ctx.sampling_defaults.get  # the model's own (`--generation-config`), else the API's
    temperature = float_field(body, "temperature", default("temperature", 1.0))
    if 0 < temperature < 1e-5:
        temperature = 0.0  # as greedy: dividing logits by it would overflow
    temperature = min(temperature, 1e6)  # beyond that it is uniform anyway; float32 would overflow
    top_p = float_field(body, "top_p", default("top_p", 1.0))
    if 0 < top_p < 1e-6:
        top_p = 1e-6  # float32 would round it to 0
    top_k = int_field(body, "top_k", default("top_k", 0), -1, 2**31 - 1)
    if top_k >= ctx.vocab_size:
        top_k = 0  # no restriction; keeps it inside int32 in the step
    repetition_penalty = float_field(body, "repetition_penalty", default("repetition_penalty", 1.0))
    if 0 < repetition_penalty < 1e-2:
        raise bad_request(f"repetition_penalty must be in [0.01, 10], got {repetition_penalty!r}",
                          param="repetition_penalty")
    kwargs = dict(
        n=n, best_of=best_of, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=float_field(body, "min_p", default("min_p", 0.0)),
        repetition_penalty=repetition_penalty, presence_penalty=float_field(body, "presence_penalty", 0.0),
        frequency_penalty=float_field(body, "frequency_penalty", 0.0),
        seed=int_field(body, "seed", None, -2**63, 2**64 - 1),
        max_tokens=max_tokens, min_tokens=int_field(body, "min_tokens", 0, 0, ctx.max_model_len), stop=stop,
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

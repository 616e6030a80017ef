"""The `logprobs` objects of OpenAI replies (a completions choice's, a chat choice's) and vLLM's
`prompt_logprobs`."""

from __future__ import annotations

import math
from typing import Any, Sequence

from jserve.core.request import Logprob


class TokenIdNames:
    """A tokenizer whose tokens these replies name "token_id:N" (vLLM's `return_tokens_as_token_ids`:
    tokens that are not valid UTF-8 alone stay identifiable); it decodes as the one it wraps."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)


def _shown(token_id: int, lp: Logprob | None, tokenizer: Any) -> str:
    """A token as a reply's logprobs name it."""
    if isinstance(tokenizer, TokenIdNames):
        return f"token_id:{token_id}"
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else tokenizer.decode([token_id])


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -9999.0  # JSON has no -Infinity


def _token_text(token_id: int, entry: dict[int, Logprob] | None, tokenizer: Any) -> str:
    return _shown(token_id, entry.get(token_id) if entry is not None else None, tokenizer)


def _listed(token_id: int, entry: dict[int, Logprob], num_top: int | None) -> list[tuple[int, Logprob]]:
    """A position's entries as a reply lists them: `token_id` (sampled, or the prompt's) first, then
    the alternatives by rank, those past `num_top` left out (the engine may have computed more)."""
    top = sorted(((k, v) for k, v in entry.items() if k != token_id and (num_top is None or v.rank <= num_top)),
                 key=lambda kv: kv[1].rank)
    return ([(token_id, entry[token_id])] if token_id in entry else []) + top


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob] | None], tokenizer: Any,
                        offset: int, num_top: int | None = None) -> dict:
    """The `logprobs` object of a completions choice; text offsets start at `offset`. A position
    without logprobs (an echoed prompt's first token) has null for them, as in OpenAI's replies."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        tok = _token_text(tid, entry, tokenizer)
        tokens.append(tok)
        if entry is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_finite(entry[tid].logprob) if tid in entry else None)
            tops.append({_shown(k, v, tokenizer): _finite(v.logprob)
                         for k, v in sorted(_listed(tid, entry, num_top), key=lambda kv: kv[1].rank)})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob] | None], tokenizer: Any,
                    num_top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` reply field: per prompt position null (the first) or
    {token id: {logprob, rank, decoded_token}}, the prompt's token first, then `num_top` alternatives."""
    return [None if entry is None else {
        str(k): {"logprob": _finite(v.logprob), "rank": v.rank,
                 "decoded_token": v.decoded_token if v.decoded_token is not None else tokenizer.decode([k])}
        for k, v in _listed(tid, entry, num_top)} for tid, entry in zip(token_ids, logprobs)]


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], tokenizer: Any,
                  num_top: int) -> dict:
    """The `logprobs` object of a chat choice."""

    def item(token_id: int, lp: Logprob | None) -> dict:
        tok = _shown(token_id, lp, tokenizer)
        return {"token": tok, "logprob": _finite(lp.logprob) if lp is not None else None,
                "bytes": list(tok.encode("utf-8", "replace"))}

    content = []
    for tid, entry in zip(token_ids, logprobs):
        top = sorted((kv for kv in entry.items() if kv[1].rank <= num_top), key=lambda kv: kv[1].rank)
        content.append({**item(tid, entry.get(tid)), "top_logprobs": [item(k, v) for k, v in top]})
    return {"content": content}

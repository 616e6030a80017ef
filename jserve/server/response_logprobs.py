"""The `logprobs` objects of OpenAI replies: a completions choice's and a chat choice's."""

from __future__ import annotations

import math
from typing import Any, Sequence

from jserve.core.request import Logprob


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -9999.0  # JSON has no -Infinity


def _token_text(token_id: int, entry: dict[int, Logprob], tokenizer: Any) -> str:
    lp = entry.get(token_id)
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else tokenizer.decode([token_id])


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], tokenizer: Any,
                        offset: int) -> dict:
    """The `logprobs` object of a completions choice; text offsets start at `offset`."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, logprobs):
        tok = _token_text(tid, entry, tokenizer)
        tokens.append(tok)
        token_lps.append(_finite(entry[tid].logprob) if tid in entry else None)
        tops.append({(v.decoded_token if v.decoded_token is not None else tokenizer.decode([k])): _finite(v.logprob)
                     for k, v in sorted(entry.items(), key=lambda kv: kv[1].rank)})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], tokenizer: Any,
                  num_top: int) -> dict:
    """The `logprobs` object of a chat choice."""

    def item(token_id: int, lp: Logprob | None) -> dict:
        tok = lp.decoded_token if lp is not None and lp.decoded_token is not None else tokenizer.decode([token_id])
        return {"token": tok, "logprob": _finite(lp.logprob) if lp is not None else None,
                "bytes": list(tok.encode("utf-8", "replace"))}

    content = []
    for tid, entry in zip(token_ids, logprobs):
        top = sorted((kv for kv in entry.items() if kv[1].rank <= num_top), key=lambda kv: kv[1].rank)
        content.append({**item(tid, entry.get(tid)), "top_logprobs": [item(k, v) for k, v in top]})
    return {"content": content}

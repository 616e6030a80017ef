"""Scoring token sequences on the serving path (`LLM.token_logprobs`): each token's logprob given
its prefix, as the engine's prompt-logprob steps compute it (paged KV, chunked prefill, the
backend's kernels; `jserve.runtime.scoring_step`), not a separate forward pass.

A scored sequence is a request with `max_tokens=0` and `prompt_logprobs=k`: it runs beside any
other request, gives its pages back when it ends, and reads no prefix-cache hit (the engine
salts a prompt-logprob request's cache key, so every position is computed and scored).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jserve.core.request import MAX_LOGPROBS, RequestOutput, SamplingParams


@dataclasses.dataclass
class TokenLogprobs:
    """One scored sequence of n tokens. `logprobs` float32 [n - 1]: log p(token_ids[i + 1] |
    token_ids[:i + 1]) (the first token has none). With `top_k` > 0, `top_ids` int32 [n - 1, k]
    and `top_logprobs` float32 [n - 1, k]: the k likeliest next tokens at each position."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


def check_sequences(token_ids: Any, vocab_size: int, max_model_len: int) -> list[list[int]]:
    """`token_ids` as a list of id lists; ValueError naming the first bad value (and where)."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (Sequence, np.ndarray)) or not len(token_ids):
        raise ValueError(f"token_ids must be a non-empty list of token id sequences, got {token_ids!r:.80}")
    out = []
    for i, seq in enumerate(token_ids):
        if isinstance(seq, (str, bytes, int, np.integer)) or not isinstance(seq, (Sequence, np.ndarray)):
            raise ValueError(f"token_ids[{i}] must be a sequence of token ids, got {seq!r:.80}")
        if not len(seq):
            raise ValueError(f"token_ids[{i}] is empty: give at least one token")
        if len(seq) >= max_model_len:
            raise ValueError(f"token_ids[{i}] has {len(seq)} tokens but the context length is {max_model_len}: "
                             f"a scored sequence must be shorter (max_model_len)")
        ids = []
        for j, t in enumerate(seq):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"token_ids[{i}][{j}] must be an integer, got {t!r:.80}")
            if not 0 <= t < vocab_size:
                raise ValueError(f"token_ids[{i}][{j}] = {int(t)} is outside the vocabulary [0, {vocab_size})")
            ids.append(int(t))
        out.append(ids)
    return out


def scoring_params(top_k: int = 0) -> SamplingParams:
    """The request that scores a sequence: no output tokens, the prompt's logprobs (and top k)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_LOGPROBS:
        raise ValueError(f"top_k must be an integer in [0, {MAX_LOGPROBS}], got {top_k!r}")
    return SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=top_k)


def from_output(out: RequestOutput, top_k: int = 0) -> TokenLogprobs:
    """A finished scoring request's `TokenLogprobs`."""
    ids = list(out.prompt_token_ids)
    entries = out.prompt_logprobs[1:]
    if len(entries) != len(ids) - 1:
        raise RuntimeError(f"request {out.request_id}: {len(entries)} prompt logprobs for {len(ids)} tokens")
    logprobs = np.array([e[t].logprob for e, t in zip(entries, ids[1:])], np.float32)
    result = TokenLogprobs(np.asarray(ids, np.int32), logprobs)
    if top_k:
        top = [list(e.items())[:top_k] for e in entries]  # the k likeliest come first in each entry
        result.top_ids = np.array([[t for t, _ in row] for row in top], np.int32).reshape(-1, top_k)
        result.top_logprobs = np.array([[lp.logprob for _, lp in row] for row in top], np.float32).reshape(-1, top_k)
    return result

"""What one request may ask for and what the server admits at once, counted in what it costs.

`Limits` holds every knob with its default (the CLI flags of `jserve serve` set them);
`resolve()` fills the ones that depend on the model. `Admission` is the server's ledger of
admitted work: sequences (a request with `n=4` over 2 prompts is 8) and tokens (prompt plus
`max_tokens` per sequence, the KV they may come to hold). Past either limit a request gets 429
with `Retry-After`, before it reaches the engine.
"""

from __future__ import annotations

import dataclasses

from jserve.server.errors import APIError


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request and server-wide limits (None: derived from the model in `resolve`)."""

    # admission (429 past them)
    max_queue: int = 256  # sequences allowed to wait beyond the engine's max_num_seqs
    max_queued_tokens: int | None = None  # prompt + max_tokens over admitted sequences; None: 8 KV pools
    # one request (400 past them)
    max_input_tokens: int | None = None  # per prompt; None: max_model_len - 1 (TGI's max-input-tokens)
    max_total_tokens: int | None = None  # prompt + max_tokens per sequence; None: max_model_len
    max_n: int = 64  # sequences per request: n times the number of prompts
    max_prompts: int = 64
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # characters per stop string (each is scanned at every step)
    max_stop_token_ids: int = 64
    max_logprobs: int = 20  # logprobs / top_logprobs (at most jserve.core.request.MAX_LOGPROBS)
    max_cache_salt_chars: int = 256
    # work off the event loop
    max_tokenize_jobs: int = 32  # large bodies waiting for (or in) the tokenizer process; then 429

    def resolve(self, *, max_model_len: int, num_kv_tokens: int, max_num_seqs: int) -> "Limits":
        """These limits with the model-dependent defaults filled in and every value checked."""
        from jserve.core.request import MAX_LOGPROBS

        total = self.max_total_tokens or max_model_len
        out = dataclasses.replace(
            self, max_total_tokens=min(total, max_model_len),
            max_input_tokens=min(self.max_input_tokens or max_model_len - 1, max_model_len - 1, total - 1),
            max_queued_tokens=self.max_queued_tokens or max(8 * num_kv_tokens, max_num_seqs * max_model_len),
            max_logprobs=min(self.max_logprobs, MAX_LOGPROBS))
        for field in dataclasses.fields(out):
            value = getattr(out, field.name)
            if not isinstance(value, int) or value < (0 if field.name in ("max_queue", "max_logprobs") else 1):
                raise ValueError(f"limit {field.name} must be a positive integer, got {value!r}")
        return out


class Admission:
    """Sequences and tokens admitted and not yet finished (event-loop only: no lock)."""

    def __init__(self, max_seqs: int, max_tokens: int):
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        self.seqs = 0
        self.tokens = 0

    def check(self, seqs: int, tokens: int) -> None:
        """429 if `seqs` more sequences costing `tokens` would not fit now."""
        if seqs > self.max_seqs:  # would never fit: not worth a retry
            raise APIError(400, f"this request runs {seqs} sequences (n times the prompts), more than the "
                                f"server admits at once ({self.max_seqs})", param="n", code="request_too_large")
        if self.seqs + seqs > self.max_seqs:
            raise _full(f"too many sequences in flight ({self.seqs} admitted, this request adds {seqs}, "
                        f"limit {self.max_seqs})")
        if self.tokens + tokens > self.max_tokens:
            if tokens > self.max_tokens:  # would never fit: not worth a retry
                raise APIError(400, f"this request may use {tokens} tokens (prompts plus max_tokens, times n), "
                                    f"more than the server admits at once ({self.max_tokens})",
                               param="max_tokens", code="request_too_large")
            raise _full(f"too many tokens in flight ({self.tokens} admitted, this request may use {tokens}, "
                        f"limit {self.max_tokens})")

    def take(self, seqs: int, tokens: int) -> None:
        self.check(seqs, tokens)
        self.seqs += seqs
        self.tokens += tokens

    def give_back(self, seqs: int, tokens: int) -> None:
        self.seqs -= seqs
        self.tokens -= tokens


def _full(what: str) -> APIError:
    return APIError(429, f"{what}; retry later", code="queue_full", headers={"Retry-After": "1"})

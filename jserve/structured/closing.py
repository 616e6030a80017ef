"""Closing a constrained output within its token budget (`structured_outputs.close_at_limit`).

A sequence that opts in knows how many tokens it may still generate (`max_tokens`, and the room
left in the context). Each step, once that budget is near (`CLOSE_HORIZON`), `Closer.narrow`
estimates the grammar's shortest completion from the sequence's state with a greedy walk over
closing tokens (forced tokens, then `"`, `}`, `]` and their merges, then short values such as
`0`, `""`, `null`, then single bytes), on a copy of the matcher. When the budget left is within
`CLOSE_MARGIN` tokens of that estimate, the step's mask keeps only the candidate tokens after
which the walk still ends within the budget. The walk's own first token always qualifies, so a
document whose estimate fits the budget when the narrowing starts ends complete ("stop"); one
that cannot fit runs on as before and ends at the limit ("length").
See docs/architecture.md, "Structured outputs".
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

CLOSE_HORIZON = 64  # no estimate while more tokens than this are left
CLOSE_MARGIN = 8  # narrow the mask once the budget is within this many tokens of the estimate
_SINGLE_BYTES_TRIED = 16  # single-byte candidates the narrowed mask may keep, at most
_CLOSING = frozenset(b'"}])')
_CLOSER_BYTES = frozenset(b'"}]): ')
_VALUES = (b"0", b'""', b"{}", b"[]", b"null", b"true", b"false")
_TEXT = b" etaoinsrhldcumfpgwybvkxjqz0123456789"


def _text_first(b: bytes) -> tuple[int, bytes]:
    """Single bytes as text uses them (letters by frequency, digits), then the rest."""
    i = _TEXT.find(b)
    return (i if i >= 0 else len(_TEXT), b)


def _punctuation_first(b: bytes) -> tuple[bool, bytes]:
    """Single bytes that likely end a part of a grammar (punctuation) before those inside one."""
    return (b.isalnum() or b == b" ", b)


class Closer:
    """One vocabulary's closing candidates, in the orders the greedy walks try them.

    Two walks: one tries tokens with a `"` first (inside a string only they make progress), the
    other `}`, `]` and `)` first (after `{` or `[` they close at once); the estimate is the
    shorter. Then short values, then single bytes (punctuation first: letters rarely end anything).
    """

    def __init__(self, token_bytes: Sequence[bytes], eos_token_ids: Sequence[int]):
        closers = [t for t, b in enumerate(token_bytes) if b and set(b) <= _CLOSER_BYTES and set(b) & _CLOSING]
        by_bytes = {b: t for t, b in enumerate(token_bytes) if b}
        values = [by_bytes[v] for v in _VALUES if v in by_bytes and by_bytes[v] not in closers]
        singles = [t for t, b in enumerate(token_bytes) if len(b) == 1 and 32 <= b[0] < 127
                   and t not in closers and t not in values]
        tail = sorted(singles, key=lambda t: _punctuation_first(token_bytes[t]))
        self.orders = []
        for quote_first in (True, False):
            ranked = sorted(closers, key=lambda t: ((b'"' in token_bytes[t]) != quote_first,
                                                    -len(token_bytes[t].strip()), t))
            self.orders.append(np.array(ranked + values + tail, np.int64))
        self.structural = np.array(closers + values, np.int64)
        self.text = np.array(sorted(singles, key=lambda t: _text_first(token_bytes[t])), np.int64)
        self.eos = [int(t) for t in eos_token_ids]

    @classmethod
    def for_tokenizer(cls, llg_tokenizer: Any) -> "Closer":
        """From llguidance's tokenizer (special tokens have no bytes here)."""
        n = llg_tokenizer.vocab_size
        data = [b"" if llg_tokenizer.is_special_token(t) else llg_tokenizer.decode_bytes([t]) for t in range(n)]
        return cls(data, llg_tokenizer.eos_tokens)

    @staticmethod
    def _bits(words: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` a mask (uint32 words) allows."""
        return ((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)

    def _step(self, matcher: Any, order: np.ndarray) -> int | None:
        """A walk's next token: a forced one, else the first candidate allowed."""
        forced = matcher.compute_ff_tokens()
        if forced:
            return int(forced[0])
        hits = np.flatnonzero(self._bits(np.frombuffer(matcher.compute_bitmask(), np.uint32), order))
        return int(order[hits[0]]) if hits.size else None

    def _walk(self, matcher: Any, limit: int, order: np.ndarray) -> int | None:
        n = 0
        while True:
            if matcher.is_error():
                return None
            if matcher.is_stopped():
                return n
            if matcher.is_accepting():
                return n + 1 if n < limit else None
            if n >= limit:
                return None
            token = self._step(matcher, order)
            if token is None or not matcher.consume_token(token):
                return None
            n += 1

    def shortest(self, matcher: Any, limit: int) -> int | None:
        """Tokens the shorter walk takes to end the grammar from `matcher` (left as it is), an
        end-of-sequence token included where the grammar needs one; None past `limit` or stuck."""
        best = None
        for order in self.orders:
            n = self._walk(matcher.deep_copy(), limit if best is None else best - 1, order)
            best = n if n is not None else best
        return best

    def narrow(self, matcher: Any, row: np.ndarray, remaining: int) -> int | None:
        """Restrict `row` (the matcher's int32 mask words, filled) to closing tokens once
        `remaining` tokens are within `CLOSE_MARGIN` of the walk's estimate; returns the estimate
        (None: none within the horizon, or the walk is stuck: the row is left as it is)."""
        if remaining > CLOSE_HORIZON:
            return None
        estimate = self.shortest(matcher, remaining)
        if estimate is None or remaining - estimate > CLOSE_MARGIN:
            return estimate
        keep = [t for t in self._candidates(matcher, row) if self._fits(matcher, t, remaining - 1)]
        if not keep:  # the walk's own first token fits, unless the library disagrees with itself
            return estimate
        row[:] = 0
        ids = np.array(keep, np.int64)
        np.bitwise_or.at(row.view(np.uint32), ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
        return estimate

    def _candidates(self, matcher: Any, row: np.ndarray) -> list[int]:
        """The tokens worth a walk: a forced one, the allowed structural ones, a few allowed
        single bytes (as text would use them), EOS where the grammar may end."""
        words = row.view(np.uint32)
        out = [int(t) for t in matcher.compute_ff_tokens()[:1]]
        out += self.structural[self._bits(words, self.structural)].tolist()
        out += self.text[self._bits(words, self.text)][:_SINGLE_BYTES_TRIED].tolist()
        if matcher.is_accepting():
            out += self.eos
        return list(dict.fromkeys(out))

    def _fits(self, matcher: Any, token: int, limit: int) -> bool:
        copy = matcher.deep_copy()
        return copy.consume_token(token) and self.shortest(copy, limit) is not None

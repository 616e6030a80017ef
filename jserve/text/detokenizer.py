"""Streaming detokenization: turn generated ids into text deltas as they arrive.

Each step decodes a short window of recent ids twice (without and with the new ids) and emits the
difference, so byte-level merges and sentencepiece's leading-space rule are applied exactly as a
full decode would; text ending in an incomplete UTF-8 sequence (U+FFFD) is held back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jserve.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Prompt ids decoded as context for the first generated ids (as in vLLM): enough for a
# sentencepiece piece to see that it is not at the start of the text.
_NUM_CONTEXT_IDS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for one sequence of generated ids.

    The deltas concatenate to `tokenizer.decode(prompt_ids + generated)` with the prompt's own text
    removed; with no prompt (or a prompt that ends on a special token) that is exactly
    `tokenizer.decode(generated)`. Byte-level BPE decodes the same either way; sentencepiece drops
    the leading space of a standalone decode, which a continuation of a prompt keeps.

    Attributes:
      text: all text emitted so far.
    """

    def __init__(self, tokenizer: "Tokenizer", prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = [int(i) for i in prompt_ids]
        self._read_offset = len(self._ids)  # ids before this have been emitted as text
        self._prefix_offset = max(0, self._read_offset - _NUM_CONTEXT_IDS)  # decode window start
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        """Prompt ids followed by all ids added so far."""
        return list(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends generated ids; returns the text they complete (possibly "")."""
        self._ids.extend(int(i) for i in token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Returns any held-back text, incomplete UTF-8 included (as U+FFFD), e.g. when a request ends."""
        return self._step(final=True)

    def _step(self, *, final: bool) -> str:
        if len(self._ids) == self._read_offset:
            return ""
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        full_text = decode(self._ids[self._prefix_offset:], skip_special_tokens=skip)
        if not final and (full_text.endswith(_REPLACEMENT) or len(full_text) <= len(prefix_text)):
            # An incomplete character (or nothing visible yet): wait for more ids.
            return ""
        if not full_text.startswith(prefix_text):
            logger.debug("decode of the window is not prefix-stable: %r vs %r", prefix_text, full_text)
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

"""vLLM's `bad_words`: words a request must not generate, as token sequences, and the tokens a
step bans given the sequence's output so far (pure Python).

A word is banned as its tokens both alone and after a space (the second only where the space
starts a different first token of the same length, as vLLM decides). A sequence's last token is
banned where the output ends with the rest of the sequence (a one-token word: always). The step
applies the bans as -inf entries beside logit_bias' (`jserve.runtime.sampler`); a request with a
word of several tokens needs each sample on the host before the next step's bans are known.
"""

from __future__ import annotations

from typing import Callable, Sequence


def token_sequences(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """Each word's token sequences (`encode`: text -> ids, no special tokens added)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if plain:
            out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return tuple(dict.fromkeys(out))


def banned_ids(sequences: Sequence[Sequence[int]], output_ids: Sequence[int]) -> tuple[int, ...]:
    """The tokens the next sample may not be: each sequence's last where the output ends with
    the tokens before it."""
    n = len(output_ids)
    out = []
    for seq in sequences:
        k = len(seq) - 1
        if k == 0 or (k <= n and all(output_ids[n - k + i] == seq[i] for i in range(k))):
            out.append(seq[-1])
    return tuple(dict.fromkeys(out))

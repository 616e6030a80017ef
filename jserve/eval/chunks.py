"""Cutting a token stream into scoring chunks the way llama.cpp's `llama-perplexity` does.

`chunk_tokens` gives the `Chunks` to score; its docstring spells out llama.cpp's rules
(tools/perplexity/perplexity.cpp). See docs/architecture.md, "Quantization", for where `jserve
eval` fits.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Chunks:
    """The chunks to evaluate and which of their positions are scored."""

    tokens: np.ndarray  # int32 [n_chunks, ctx], BOS in column 0 where the model adds one
    targets: np.ndarray  # int32 [n_chunks, n_scored]: the next tokens at the scored positions
    ctx: int
    first: int  # llama.cpp's `first = n_ctx / 2`
    bos: int | None

    @property
    def num_chunks(self) -> int:
        return self.tokens.shape[0]

    @property
    def logit_positions(self) -> np.ndarray:
        """The positions whose logits are scored: first..ctx-2."""
        return np.arange(self.first, self.ctx - 1, dtype=np.int32)

    @property
    def num_scored(self) -> int:
        return self.ctx - 1 - self.first


def chunk_tokens(tokens: Sequence[int], ctx: int = 512, *, bos: int | None = None,
                 max_chunks: int | None = None) -> Chunks:
    """`tokens` (the whole text, tokenized with BOS where the model adds one) cut as llama.cpp
    cuts them; `bos` the BOS id where the model adds one (it replaces each chunk's first token).

    llama.cpp (tools/perplexity/perplexity.cpp, `perplexity` and `kl_divergence`):

    - the text is tokenized once, with the model's BOS when its vocabulary adds one;
    - it is cut into `n_chunk = len(tokens) // n_ctx` chunks of `n_ctx` consecutive tokens (the
      tail is dropped; `--chunks N` takes the first N), each evaluated from an empty KV cache at
      positions 0..n_ctx-1;
    - where the model adds BOS, each chunk's first token is replaced by BOS (its original token is
      kept for nothing else: it is never a target);
    - `first = n_ctx / 2`: the logits at positions first..n_ctx-2 are scored against the tokens at
      first+1..n_ctx-1, so each chunk scores `n_ctx - 1 - first` tokens (255 of 512).

    llama.cpp needs at least 2 * n_ctx tokens; so does `chunk_tokens`.
    """
    if ctx < 4 or ctx % 2:
        raise ValueError(f"ctx must be an even number >= 4, got {ctx}")
    tokens = np.asarray(tokens, np.int32)
    if len(tokens) < 2 * ctx:
        raise ValueError(f"the text has {len(tokens)} tokens: at least 2 * ctx = {2 * ctx} are needed "
                         f"(llama.cpp's rule); give a longer text or a smaller --ctx")
    n = len(tokens) // ctx
    if max_chunks is not None:
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        n = min(n, max_chunks)
    chunks = tokens[:n * ctx].reshape(n, ctx).copy()
    first = ctx // 2
    targets = chunks[:, first + 1:].copy()
    if bos is not None:
        chunks[:, 0] = bos
    return Chunks(chunks, targets, ctx, first, bos)
